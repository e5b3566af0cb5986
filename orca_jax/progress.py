"""Progress bars for what a user of the library waits on: `LLM(...)`'s start, generate, fine_tune.

tqdm.auto draws a widget in a notebook and text elsewhere. In a notebook without ipywidgets it warns
("IProgress not found") and falls back to its text bar, which a notebook shows as well: the warning
is silenced here, and the `notebook` extra installs ipywidgets for the widget.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="IProgress not found")
    from tqdm.auto import tqdm

from orca_jax.worker.precompile_progress import PrecompilePhase, PrecompileProgress

__all__ = ["StartupBar", "tqdm"]

_COUNTING = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # desc ends in ": "


class StartupBar:
    """An engine's start on one bar: loading the model (elapsed time), compiling its programs (with
    an estimate of the time left), their first runs. Pass it as the engine's precompile progress."""

    def __init__(self, model: str, *, enabled: bool = True):
        # No clock while loading: tqdm redraws only on an update, so it would stand at 00:00.
        self._bar = tqdm(total=None, desc=f"loading {model}", bar_format="{desc} ...", disable=not enabled,
                         dynamic_ncols=True)
        self._phase: PrecompilePhase | None = None

    def __call__(self, progress: PrecompileProgress) -> None:
        self._bar.set_postfix_str(progress.note, refresh=False)
        if progress.phase is not self._phase:
            self._phase = progress.phase
            self._bar.bar_format = _COUNTING
            self._bar.set_description(progress.phase.value, refresh=False)
            self._bar.reset(total=progress.total)
        self._bar.n = progress.done
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
