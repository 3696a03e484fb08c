"""``--fix``: the user's own file, rewritten to run the best plan, every other setting kept.

Each launcher's home edits its own file (``pipeplan.launchers.<name>.fix``); this is the
dispatch. Edits are made in the text, not by re-serialising, so comments, variables, arrays and
the order of everything else survive: Megatron flags are replaced where they are written (or in the
variable assignment they read), removed, or added after ``--pipeline-model-parallel-size``;
torchtitan keys are replaced, removed or added in their TOML table; DeepSpeed's ds_config keeps
its keys (JSON has no comments) and the partition goes to ``<output stem>.parts.json``, as
``pipeplan export --format deepspeed`` writes it.
"""

from __future__ import annotations

from pipeplan.formats.plan import Plan
from pipeplan.launchers.config import LauncherConfig
from pipeplan.launchers.deepspeed.fix import fix_deepspeed
from pipeplan.launchers.megatron.fix import edit_flag, fix_megatron
from pipeplan.launchers.torchtitan.fix import edit_toml_key, fix_torchtitan

__all__ = ["fix_config", "edit_flag", "edit_toml_key"]


def fix_config(config: LauncherConfig, text: str, plan: Plan, profile, output: str) -> dict[str, str]:
    """The files ``--fix -o output`` writes: path to text, the config first.

    Raises
    ------
    BadInputError
        The plan cannot be said in the launcher's settings (see the exporters).
    """
    if config.launcher == "megatron":
        return {output: fix_megatron(config, text, plan, profile)}
    if config.launcher == "torchtitan":
        return {output: fix_torchtitan(config, text, plan, profile)}
    return fix_deepspeed(config, text, plan, output)
