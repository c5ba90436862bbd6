"""A discrete-event cluster simulator for routing policies (`deja bench sim`).

The routers are the real ones' decision code (service/router/policy.py, service/router/cost.py)
over the real in-memory affinity store and replica agent (service/affinity/memory.py,
service/replica/agent.py); only the replicas are simulated: a continuous-batching scheduler like
engine/core/scheduler.py whose step times follow a calibrated cost model (bench/sim/profile.py).
"""
