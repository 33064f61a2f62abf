"""Support tooling shared by the tests and tools/ (not imported by `import torch`)."""
