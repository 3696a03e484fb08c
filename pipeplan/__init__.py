"""pipeplan: an auto-partitioning planner for pipeline-parallel training.

Data flow: model --profile--> profile.json --plan--> plan.json --run/export/check-->.
Planning needs neither torch nor a GPU; only profiling and running import torch.
"""

__version__ = "0.1.0"
