"""Entry point for PyTorch's backend autoload (group `torch.backends`).

`import torch` calls `_autoload()` at the end of its own import, so users never need to
`import neuronlocal`. PyTorch's TORCH_DEVICE_BACKEND_AUTOLOAD=0 switches this off.
"""


def _autoload() -> None:
    import neuronlocal  # noqa: F401  (importing registers the device)
