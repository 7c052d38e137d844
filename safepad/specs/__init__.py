"""Per-family declarative specs (registry keyed by ``config.model_type`` and mixer class name)."""

from . import mamba2_family  # noqa: F401 - registers the Mamba2-family specs
from . import mamba1_family  # noqa: F401
from . import gdn_family  # noqa: F401
from . import inkling_family  # noqa: F401
from . import zaya_family  # noqa: F401
from . import glm5_family  # noqa: F401
from . import recurrent_gemma_family  # noqa: F401
from . import qwen4_exp_family  # noqa: F401
from .registry import MixerSpec, all_specs, register, spec_for_module, specs_for_model_type, supported_model_types

__all__ = ["MixerSpec", "all_specs", "register", "spec_for_module", "specs_for_model_type", "supported_model_types"]
