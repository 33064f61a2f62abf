"""Type stub of neuronlocal._C, the C++ core (src/neuronlocal/csrc, bindings in module.cpp).

Its functions are private to neuronlocal: the Python layers that wrap them carry the types.
"""

from typing import Any

def __getattr__(name: str) -> Any: ...
