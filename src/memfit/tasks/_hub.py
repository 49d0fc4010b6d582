"""The Hugging Face hub during a task's build: asked once whether it can be reached, else not at all.

# NOTE [One hub probe]
Offline, every hub lookup of ``huggingface_hub`` retries with back-off (tens of seconds for
one config) and transformers tries several files per model, so each fallback to memfit's
bundled configs or the MiniLM would come only after those retries. So ``memfit train`` asks
the hub once, before the recipe builds anything:

Rule 1. Names that need no hub (a local path, a config memfit bundles, the shipped MiniLM)
never contact it: with nothing else named, the build runs in offline mode.
Rule 2. Otherwise one HEAD request to the hub's endpoint, with a short timeout, decides: when
it fails, the build runs in offline mode (files already in the local cache still load; the
bundled and MiniLM fallbacks apply at once), and one warning says so.
Rule 3. ``HF_HUB_OFFLINE`` set by the user is left as it is, and nothing is probed.
Offline mode is set for the build only and restored after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from memfit.tasks._common import DataTrainingArguments, ModelArguments, bundled_config

__all__ = ["hub_names", "hub_reachable", "hub_or_offline"]

logger = logging.getLogger(__name__)

#: Seconds the one probe of the hub may take (NOTE [One hub probe], rule 2).
PROBE_TIMEOUT_S = 3.0


def hub_names(model_args: ModelArguments, data_args: DataTrainingArguments, *, tokenizer: bool = True) -> list[str]:
    """The names in the flags that only the hub can resolve (NOTE [One hub probe], rule 1).

    Args:
        model_args: the model flags.
        data_args: the data flags (``--dataset_name`` is a hub name).
        tokenizer: whether the task loads a tokenizer (by default the model's or config's name).
    """
    names = []
    if model_args.model_name_or_path and not Path(model_args.model_name_or_path).exists():
        names.append(model_args.model_name_or_path)
    if model_args.config_name and not Path(model_args.config_name).exists() and not bundled_config(model_args.config_name):
        names.append(model_args.config_name)
    if tokenizer:
        name = model_args.tokenizer_name or model_args.model_name_or_path or model_args.config_name
        if name and not Path(name).exists():
            names.append(name)
    if data_args.dataset_name and not Path(data_args.dataset_name).exists():
        names.append(data_args.dataset_name)
    return list(dict.fromkeys(names))


def hub_reachable(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """One HEAD request to ``endpoint``: ``(reachable, why not)``. A server error counts as unreachable."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError as err:
        return err.code < 500, f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return False, str(getattr(err, "reason", err))
    return True, ""


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Offline mode for ``huggingface_hub`` (read at each call), transformers and datasets."""
    import sys

    from huggingface_hub import constants

    saved_env, saved_const = os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE
    datasets_config = getattr(sys.modules.get("datasets"), "config", None)
    saved_datasets = getattr(datasets_config, "HF_HUB_OFFLINE", None)
    os.environ["HF_HUB_OFFLINE"] = "1"  # for modules imported from now on (datasets copies it at import)
    constants.HF_HUB_OFFLINE = True
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved_env
        constants.HF_HUB_OFFLINE = saved_const
        if datasets_config is not None:
            datasets_config.HF_HUB_OFFLINE = saved_datasets


@contextlib.contextmanager
def hub_or_offline(names: list[str]) -> Iterator[bool]:
    """Run the block online only if ``names`` need the hub and it answers (NOTE [One hub probe]).

    Args:
        names: what :func:`hub_names` found.

    Yields:
        Whether the block runs online.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # rule 3
        yield False
        return
    if names:
        reachable, why = hub_reachable(constants.ENDPOINT)
        if reachable:
            yield True
            return
        logger.warning(
            "the Hugging Face hub (%s) is out of reach (%s): loading %s offline, from the local cache or memfit's "
            "fallbacks (bundled configs, the MiniLM tokenizer)",
            constants.ENDPOINT,
            why,
            ", ".join(names),
        )
    with _offline():
        yield False
