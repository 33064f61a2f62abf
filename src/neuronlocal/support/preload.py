"""What the support matrix's forkserver imports before it forks any row.

The worker's imports (torch, transformers, neuronlocal) and one tiny compiled step that
warms Inductor (`worker.warm`), done once here instead of once per row.
"""

from neuronlocal.support import worker

worker.warm()
