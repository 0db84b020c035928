"""What probing a (model, drafter) pairing needs once the model is loaded, built in one place.

``mlx-batchd probe`` and the engine's start-up probe both memoise verdicts by fingerprint, and the
fingerprint covers the pairing's description (weights, config, drafter, cache types, backend, the
kernel plans installed for the model) and
the draws. Built by one function, the two cannot drift apart: a verdict the command stored is the
one serving finds for the same model and drafter, instead of a silent re-probe (or a verdict for
different draws) after one copy changed and the other did not.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.api import ProbePolicy
from workers.exact.draws import Draw, MakeCache
from workers.exact.probe import Verdict, make_draws, probe_steps, sliding_window
from workers.exact.verdict_store import VerdictStore, serving_pairing
from workers.kernels import compiled_layers, fastpath
from workers.models import LoadedModel


@dataclass(frozen=True)
class ProbeSetup:
    """A loaded model's probe ingredients for one drafter; the draws depend on K, so they are made
    per call of :meth:`steps`."""

    #: Fresh serving caches for the model (the probe runs every draw on new ones).
    make_cache: MakeCache
    #: Everything that can change a verdict, as fingerprinted (``serving_pairing``).
    pairing: dict[str, Any]
    #: Where verdicts are memoised; ``None`` neither reads nor writes them.
    store: VerdictStore | None
    vocab_size: int
    context_length: int
    window: int | None

    def draws(self, k: int) -> list[Draw]:
        """The probe's draws for a verify block of ``k + 1`` tokens on this model."""
        return make_draws(k, self.vocab_size, self.context_length, self.window)

    def steps(
        self,
        model: Any,
        k: int,
        policy: ProbePolicy,
        force: bool = False,
        warm: list[int] | None = None,
        max_batch: int | None = None,
    ) -> Generator[str, None, Verdict]:
        """The probe as steps (one forward each), ending in the verdict. ``model`` is what the forwards
        run through: the loaded model, or the engine's counted wrapper of it so its pins are tallied.
        ``warm``: the block lengths whose verify kernels are built at the verdict's level first (a
        serving engine's probe: ``verify_warmup.block_lengths``); ``max_batch``: the most sequences the
        engine decodes together (the pin's cost is measured up to it)."""
        return probe_steps(
            model, self.make_cache, self.pairing, self.draws(k), k, self.store, policy, force, warm, max_batch
        )


def probe_setup(loaded: LoadedModel, drafter: str, *, store: bool = True) -> ProbeSetup:
    """The probe set-up for ``loaded`` paired with the drafter named ``drafter`` (``none`` for
    verify blocks without one), with the verdict store under the cache directory unless ``store``
    is false."""
    from mlx_lm.models.cache import make_prompt_cache

    from workers.models import cache_dir

    def make_cache() -> list[Any]:
        return make_prompt_cache(loaded.model)

    root = cache_dir()
    return ProbeSetup(
        make_cache=make_cache,
        pairing=serving_pairing(
            Path(loaded.info.path),
            loaded.config,
            drafter,
            make_cache(),
            root / "probe",
            fastpath.installed(loaded.model),
            compiled_layers.lone(loaded.model),
        ),
        store=VerdictStore(root / "verdicts") if store else None,
        vocab_size=loaded.info.vocab_size,
        context_length=loaded.info.context_length,
        window=sliding_window(loaded.config),
    )
