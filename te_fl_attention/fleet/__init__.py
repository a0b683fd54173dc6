"""Mixed fleets: which backend each config runs on each device type, and agreement in a job.

* :func:`plan` (``fleet/plan.py``) answers "configs x device types" without those GPUs: a
  :class:`FleetPlan` whose cells are ``verified`` (the verdicts were produced on a real GPU of
  that type: the local GPU, or rows another machine left in the probe cache or its shared Redis
  tier) or ``predicted`` (rules plus deviceless cuDNN graph builds).
* :func:`agree` (``fleet/agree.py``) runs inside a ``torch.distributed`` job: one rank per device
  type probes, every rank receives every type's results, and the ranks either each run their
  type's best (``local``) or all run the best backend supported everywhere (``uniform``,
  ``fleet/uniform.py``). It always issues exactly two collectives, whatever the caches hold (see
  vLLM #57423).
* :func:`agree_from_env` reads ``TE_FL_ATTN_AGREE`` (``off`` | ``local`` | ``uniform``).
* ``fleet/report.py`` writes a plan as one self-contained HTML page.
"""

from __future__ import annotations

from .agree import AGREE_ENV, AGREE_MODES, agree, agree_from_env, agreed, dist_ready
from .labels import choice_label, clip, describe, device_type, short_reason
from .plan import PREDICTED, VERIFIED, Cell, Configs, FleetPlan, plan
from .replay import replay
from .uniform import Uniform, common_choice

__all__ = [
    "AGREE_ENV",
    "AGREE_MODES",
    "PREDICTED",
    "VERIFIED",
    "Cell",
    "Configs",
    "FleetPlan",
    "replay",
    "Uniform",
    "agree",
    "agree_from_env",
    "agreed",
    "choice_label",
    "clip",
    "common_choice",
    "describe",
    "device_type",
    "dist_ready",
    "plan",
    "short_reason",
]
