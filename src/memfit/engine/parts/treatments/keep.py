"""``keep``: the block runs plainly and keeps everything it saves for backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.engine.parts.treatments.base import KEEP, Treatment

if TYPE_CHECKING:
    from memfit.engine.parts.treatments.base import Block

__all__ = ["Keep"]


class Keep(Treatment):
    """The block runs plainly and keeps what it saves."""

    name = KEEP
    help = "the block as it is"

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return block.run_body(*args, **kwargs)
