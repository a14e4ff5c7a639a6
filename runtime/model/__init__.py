"""The model: its config, loading and quantizing a checkpoint, the linear layers and the rules
and probe that pick their kernels, and one step's forward pass."""
