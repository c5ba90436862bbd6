"""`deja gateway`: the SMG gateway (OpenAI HTTP) in front of deja replicas."""
