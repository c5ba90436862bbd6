"""Random-weight checkpoints and tiny tokenizers, built offline: what the tests and the
benchmarks run on where no real model may be downloaded (as torch.testing and numpy.testing ship
with their packages). Nothing in the engine imports this."""
