"""``accel.utils`` under Accelerate: the same names from ``accelerate.utils``."""

from accelerate.local_sgd import LocalSGD  # noqa: F401
from accelerate.utils import *  # noqa: F401,F403
from accelerate.utils import tqdm  # noqa: F401
