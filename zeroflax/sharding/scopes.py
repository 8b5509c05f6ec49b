"""Names the train step writes into the HLO's metadata (`jax.named_scope`), where the reports read them.

The compiled program keeps each operation's name stack as its `op_name`; these scopes make the parts of
the step and the model's blocks findable there: the memory report finds ZeRO-3's gathers by group, the
memory explainer charges every buffer to a layer and a part of the step.
"""
import re

GROUP_SCOPE, SCOPE_END = "zeroflax_group[", "]"  # + the group's module path: one gather group
LAYERS_SCOPE = "zeroflax_layers["  # + the number of stacked layers: one `scan_layers` loop
GRAD_SYNC_SCOPE = "zeroflax_grad_sync"  # the gradient synchronisation across `data`
UPDATE_SCOPE = "zeroflax_update"  # clipping, the optimizer's update and its application
GROUP_NAME = re.compile(re.escape(GROUP_SCOPE) + r"(.*?)" + re.escape(SCOPE_END))  # a group's name in an op_name
