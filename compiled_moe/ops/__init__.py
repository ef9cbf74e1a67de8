"""Op registration: importing this package registers every torch.ops.compiled_moe op."""

from compiled_moe.ops import grouped_mm  # noqa: F401
from compiled_moe.ops import routing  # noqa: F401
from compiled_moe.ops import activations  # noqa: F401
from compiled_moe.ops import fp8  # noqa: F401
from compiled_moe.ops import moe_mlp  # noqa: F401
