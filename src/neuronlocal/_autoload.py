"""Entry point for PyTorch's backend autoload (group `torch.backends`).

`import torch` calls `_autoload()` at the end of its own import, so users never need to
`import neuronlocal`. PyTorch's TORCH_DEVICE_BACKEND_AUTOLOAD=0 switches this off.
A neuronlocal that cannot load (say, its C++ core built against another torch) warns and
leaves `import torch` working: PyTorch would otherwise fail the whole import.
"""


def _autoload() -> None:
    try:
        import neuronlocal  # noqa: F401  (importing registers the device)
    except Exception as e:  # any failure: import torch must still work
        import warnings

        warnings.warn(f"neuronlocal could not load, so there is no neuron device: {e}. "
                      "Rebuild it against this torch: `make setup`, or `pip install -c "
                      "constraints.txt --no-build-isolation -e .` in its checkout",
                      RuntimeWarning, stacklevel=2)
