"""The plaintext lab: FL on plain tensors, the recovery baselines, and their metrics.

It implements Stage II's ports (``protocols.starfish.ports``) on plain tensors, so the
plaintext Starfish here is the same code the secure servers run on shares.
"""
