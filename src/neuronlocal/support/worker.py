"""`python -m neuronlocal.support.worker MODEL_TYPE ARCH TASK`: one row of the matrix as JSON."""

from __future__ import annotations

import json
import sys
import warnings


def main() -> None:
    model_type, arch, task = sys.argv[1:4]
    warnings.simplefilter("ignore")
    from neuronlocal.support.matrix import TASK_MODES
    from neuronlocal.support.models import check_model

    rep = check_model(model_type, arch, modes=TASK_MODES[task])
    print(json.dumps(rep.as_dict(), default=str), flush=True)


if __name__ == "__main__":
    main()
