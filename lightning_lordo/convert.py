"""From the user's optimizer to LoRDO: which parameters stay full-rank, Adam/AdamW converted into
:class:`~lightning_lordo.LoRDO` with the same param groups and hyperparameters, and the LR schedulers re-pointed
so they keep driving the learning rate."""

from __future__ import annotations

import functools
import inspect
import re
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.optim import Optimizer

from lightning_lordo.optim.lordo import LoRDO
from lightning_lordo.optim.report import plan_summary
from lightning_lordo.strategy_knobs import FROM_USER_OPTIMIZER

#: Parameter names (regular expressions) that run full-rank AdamW besides what the structure finds
#: (:func:`full_rank_params`): none; the strategies' ``full_rank_params`` adds the user's.
DEFAULT_FULL_RANK_PARAMS: tuple[str, ...] = ()

# Keys of torch.optim.Adam/AdamW param groups that LoRDO does not take (checked or dropped on conversion).
_ADAM_ONLY_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def convert_optimizer(optimizer: Optimizer, full_rank: Mapping[Tensor, str], knobs: dict[str, Any], seed: int,
                      names: dict[Tensor, str]) -> LoRDO:
    """The user's Adam/AdamW as a LoRDO optimizer with the same groups and hyperparameters (``knobs``: the
    strategy's optimizer knobs, defaults for every group). A LoRDO optimizer is returned as it is."""
    if isinstance(optimizer, LoRDO):  # LoRDOCore.attach refuses optimizer knobs given beside it
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(
            f"strategy='lordo' converts torch.optim.Adam or AdamW into LoRDO, but configure_optimizers returned "
            f"{type(optimizer).__name__}. Return Adam/AdamW or lightning_lordo.LoRDO, or use strategy='diloco' "
            "(full-rank local steps with any optimizer, averaged every K steps)."
        )
    complex_params = [names.get(p, tuple(p.shape)) for g in optimizer.param_groups for p in g["params"]
                      if p.is_complex()]
    if complex_params:  # LoRDO's state is real (float32): a step would drop the imaginary part
        raise ValueError(f"LoRDO trains real parameters, but {complex_params[:3]} are complex. Keep them as real pairs "
                         "(torch.view_as_real, torch.view_as_complex in forward), or use strategy='ddp'.")
    groups = []
    for group in optimizer.param_groups:
        modes = [k for k in ("amsgrad", "maximize", "capturable", "differentiable") if group.get(k)]
        if modes:
            raise ValueError(f"LoRDO has no {' or '.join(modes)} mode, so it would be ignored; create the Adam/AdamW "
                             f"without {modes[0]}=True.")
        coupled_decay = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay")
        if coupled_decay and group["weight_decay"]:
            warnings.warn("LoRDO applies weight decay decoupled (as AdamW); your Adam's L2 weight_decay="
                          f"{group['weight_decay']} becomes decoupled decay.", stacklevel=2)
        groups.append({k: v for k, v in group.items() if k not in _ADAM_ONLY_KEYS})
    # the user's explicit fused / foreach choice carries over (torch puts the flags in every group)
    flags: dict[str, Any] = {"fused": None}
    if any(g.get("fused") for g in optimizer.param_groups):
        flags["fused"] = True
    elif all(g.get("fused") is False for g in optimizer.param_groups):
        flags["fused"] = False
    if all(g.get("foreach") is False for g in optimizer.param_groups):
        flags["foreach"] = False  # else LoRDO's own default
    # the user's defaults, which a group added later (BaseFinetuning's unfreeze) takes, as it would from their AdamW
    defaults = {k: optimizer.defaults[k] for k in FROM_USER_OPTIMIZER if k in optimizer.defaults}
    with warnings.catch_warnings():  # the optimizer warns per shape; the strategy says it once, below
        warnings.filterwarnings("ignore", "LoRDO: rank=", UserWarning)
        lordo = LoRDO(groups, seed=seed, full_rank=full_rank, **flags, **defaults, **knobs)
    _warn_about_fullrank_matrices(lordo, names)
    return lordo


def plan_message(optimizer: LoRDO, names: Mapping[Tensor, str]) -> str:
    """The start-up log of the parameter plan: how many tensors take each step, the largest of each by name."""
    return "\n".join(plan_summary(optimizer.describe(names))) + (
        " strategy.parameter_plan() lists all; optimizer={'full_rank_params': [regex]} moves more to AdamW.")


def check_initialized(module: nn.Module) -> None:
    """Refuse lazy parameters (``nn.LazyLinear`` before its first forward pass): the strategy needs every shape at
    setup, to broadcast the model and to plan each matrix's step."""
    lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    lazy += [n for n, b in module.named_buffers() if isinstance(b, nn.parameter.UninitializedBuffer)]
    if lazy:
        raise RuntimeError(f"LoRDO needs every parameter's and buffer's shape when training starts, but {lazy[:3]} "
                           f"{'are' if len(lazy) > 1 else 'is'} not initialized yet (a lazy module such as "
                           "nn.LazyLinear). Run one forward pass with an example batch before trainer.fit (or "
                           "fabric.setup), e.g. model(example_input), as DistributedDataParallel requires too.")


def check_dense(module: nn.Module, optimizer: LoRDO) -> None:
    """Refuse embeddings with ``sparse=True`` that LoRDO steps: it takes dense gradients (as torch's Adam/AdamW)."""
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    sparse = [n for n, m in module.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
              and id(m.weight) in stepped]
    if sparse:
        raise ValueError(f"LoRDO takes dense gradients, but {sparse[:3]} {'are' if len(sparse) > 1 else 'is'} an "
                         "nn.Embedding or nn.EmbeddingBag with sparse=True. Pass sparse=False, or use "
                         "strategy='diloco' with an optimizer that takes sparse gradients (torch.optim.SGD).")


def full_rank_params(module: nn.Module, patterns: Sequence[re.Pattern[str]] = ()) -> dict[Tensor, str]:
    """The parameters SPEC §2 keeps full-rank, found by the model's structure (not by names), each with why:

    * every ``nn.Embedding`` / ``nn.EmbeddingBag`` weight, and any parameter sharing its memory (a tied head);
    * every ``nn.Linear`` whose ``out_features`` is the largest embedding's ``num_embeddings`` (a vocabulary head),
      unless some ``nn.Linear`` reads vectors of that size (then it is a hidden width);
    * the output heads (:func:`output_heads`): the last ``nn.Linear`` (or the last run of sibling ``nn.Linear``
      layers: several heads) at the end of the module tree, after parameterless layers such as dropout;
    * the parameters whose name matches one of ``patterns`` (the user's ``full_rank_params``)."""
    found: dict[Tensor, str] = {}
    embeddings = [m for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    for m in embeddings:
        for p in weights(m):
            found.setdefault(p, "embedding")
    shared = {p.data_ptr() for m in embeddings for p in weights(m)}
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    # the token table is the largest embedding (positions, segments are smaller); a width some layer reads is a hidden
    # width, not logits (a 128-position table in a 128-wide model must not make every 128-wide projection a head)
    vocabulary = max((m.num_embeddings for m in embeddings), default=None)
    if vocabulary is not None and all(m.in_features != vocabulary for m in linears):
        for m in linears:
            if m.out_features == vocabulary:
                for p in weights(m):
                    found.setdefault(p, "output head (out_features = the token embedding's vocabulary)")
    for m in output_heads(module):
        for p in weights(m):
            found.setdefault(p, "output head (the model's last linear layer)")
    for name, p in module.named_parameters():
        if p.data_ptr() in shared:
            found.setdefault(p, "tied to an embedding")
        if any(r.search(name) for r in patterns):
            found.setdefault(p, "named in full_rank_params")
    return found


def weights(m: nn.Module) -> list[Tensor]:
    """The parameters behind ``m.weight``: itself, or those a parametrization computes it from (``weight_norm``'s
    ``original0``/``original1`` or ``weight_g``/``weight_v``, ``spectral_norm``'s ``original`` or ``weight_orig``)."""
    if parametrize.is_parametrized(m, "weight"):
        return list(m.parametrizations.weight.parameters())  # type: ignore[union-attr]
    older = [getattr(m, n) for n in ("weight_g", "weight_v", "weight_orig") if isinstance(getattr(m, n, None),
                                                                                       nn.Parameter)]
    return older or [m.weight]


def output_heads(module: nn.Module) -> list[nn.Linear]:
    """The ``nn.Linear`` layers at the output end of ``module``: walking its children from the last, parameterless
    layers (dropout, activations) are passed over, a container is entered, and the first ``nn.Linear`` found is a
    head, with the ``nn.Linear`` siblings right before it that read the same input and do not feed it (several
    heads: same ``in_features``, ``out_features`` not the head's input; a layer that could feed it is a hidden
    layer). Models register their head last almost always (GPT-2's ``lm_head``, torchvision's ``fc``, Lightning's
    demo ``decoder``); a head registered elsewhere is named with ``full_rank_params``, and the plan printed at
    start-up shows what was chosen."""
    heads: list[nn.Linear] = []
    for child in reversed(list(module.children())):
        trainable = any(p.requires_grad for p in child.parameters())  # a frozen teacher or backbone is passed over
        if isinstance(child, nn.Linear) and not trainable and not heads:
            break  # a frozen output layer: no trainable layer is the head (the one before it is hidden)
        parallel = isinstance(child, nn.Linear) and trainable and (not heads or (
            child.in_features == heads[0].in_features and child.out_features != heads[0].in_features))
        if parallel:
            heads.append(child)
        elif heads or trainable:
            if not heads:
                heads = output_heads(child)
            break
    return heads


def compile_patterns(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"Invalid full_rank_params={patterns!r}: it must be a sequence of regular expressions "
                         r"(strings), e.g. optimizer={'full_rank_params': [r'lm_head\.weight$']}.")
    try:
        return [re.compile(p) for p in patterns]
    except re.error as err:
        raise ValueError(f"Invalid full_rank_params={patterns!r}: {err}. Pass valid regular expressions.") from err


def _warn_about_fullrank_matrices(optimizer: LoRDO, names: dict[Tensor, str]) -> None:
    """One warning for the matrices the rank cannot help (smaller side below the rank), or for a model with none
    that takes the low-rank step at all."""
    rows = optimizer.describe(names)
    too_small = [f"{r['name'] or r['shape']} {r['shape']}" for r in rows  # a (d, 1) column: no rank helps
                 if r["reason"].startswith("rank ") and min(r["shape"]) > 1]
    if not any(r["step"] == "lowrank" for r in rows):
        warnings.warn("LoRDO: no parameter of this model takes the low-rank step (it needs 2-D weights whose "
                      "smaller side is larger than the rank); every parameter runs AdamW locally, synchronized every "
                      "sync_every steps. Lower `rank` to use the low-rank step.", stacklevel=3)
    elif too_small:
        warnings.warn(f"LoRDO: {len(too_small)} weight matrices are not larger than the rank and run AdamW: "
                      f"{', '.join(too_small[:5])}{' ...' if len(too_small) > 5 else ''}. Lower `rank`, or opt "
                      "them out with rank=0 in their param group to silence this.", stacklevel=3)


def repoint_schedulers(configs: list[Any], old: Optimizer, new: Optimizer) -> Any:
    """Make the user's LR schedulers drive ``new`` (same groups, same order) and keep their step counts.

    Schedulers made of schedulers (``SequentialLR``, ``ChainedScheduler``) hold inner ones that point at ``old``
    too: they are re-pointed as well, and ``old`` shares ``new``'s param-group dicts, so anything else still
    holding ``old`` changes the learning rate ``new`` uses. Returns the handle of the first step's mark
    (:func:`track_step_calls`), for the caller to remove after that step."""

    def repoint(scheduler: Any) -> None:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
        for inner in getattr(scheduler, "_schedulers", ()):
            repoint(inner)

    for config in configs:
        repoint(config.scheduler)
    old.param_groups = new.param_groups
    mark = track_step_calls(new, old)
    kind = type(old).__name__

    def converted_step(*args: Any, **kwargs: Any) -> None:  # its groups lost Adam's own keys: torch would KeyError
        raise RuntimeError(f"This {kind} was converted to lightning_lordo.LoRDO by the strategy, which steps the "
                           "converted one (and synchronizes around it). Step the optimizer that fabric.setup / "
                           "fabric.setup_optimizers returned (the Trainer steps its own), not the one passed in.")

    converted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # a scheduler left on it stays quiet
    old.step = converted_step  # type: ignore[method-assign]
    old.add_param_group = new.add_param_group  # type: ignore[method-assign]  # a group added through it (a callback
    # holding the user's optimizer) lands in the optimizer that steps, with its knobs
    return mark


def cycling_momentum(schedulers: Sequence[Any]) -> list[str]:
    """The schedulers (those inside ``SequentialLR``/``ChainedScheduler`` too) that set beta1 at every step
    (``cycle_momentum=True``: OneCycleLR, CyclicLR)."""
    return [type(s).__name__ for s in schedulers if getattr(s, "cycle_momentum", False)] + [
        name for s in schedulers for name in cycling_momentum(getattr(s, "_schedulers", ()))]


def check_switch_betas(schedulers: Sequence[Any], switch_betas: Any) -> None:
    """Refuse ``switch_betas`` beside a scheduler that would overwrite its beta1 at every step."""
    cycling = cycling_momentum(schedulers)
    if cycling:
        raise ValueError(f"Invalid switch_betas={switch_betas!r}: your {cycling[0]} cycles the momentum "
                         "(cycle_momentum=True) and sets beta1 at every step, so switch_betas' beta1 would be "
                         "overwritten after the switch. Pass cycle_momentum=False, or drop switch_betas.")


def scale_scheduler_lrs(scheduler: Any, scale: float) -> None:
    """Multiply the learning rates a scheduler keeps (and those of the schedulers inside it) by ``scale``: its base
    LRs, CyclicLR's peaks, ReduceLROnPlateau's and the cosine schedules' floors. After the switch at the end of the
    warm-up the whole schedule follows the param groups' learning rates the synchronizer scaled (OneCycleLR keeps
    its LRs in the groups)."""
    if scale == 1.0:
        return
    for name in ("base_lrs", "max_lrs", "min_lrs"):
        if isinstance(getattr(scheduler, name, None), list):
            setattr(scheduler, name, [lr * scale for lr in getattr(scheduler, name)])
    if isinstance(getattr(scheduler, "eta_min", None), (int, float)):
        scheduler.eta_min = scheduler.eta_min * scale
    for inner in getattr(scheduler, "_schedulers", ()):
        scale_scheduler_lrs(inner, scale)


def unfrozen_message(new: list[str]) -> str:
    return (f"LoRDO synchronizes the parameters that were trainable when training started, but {new[:5]} became "
            "trainable later; they would drift apart on every rank. Unfreeze them before trainer.fit / fabric.setup, "
            "or save a checkpoint and resume to include them. A callback that unfreezes during fit (Lightning's "
            "BaseFinetuning, BackboneFinetuning) freezes them again on resume: train in two fits instead, the second "
            "from the first's checkpoint with them trainable and without the callback.")


def undriven_step_message(owner: str) -> str:
    fix = ("step the optimizer fabric.setup returned, not the one inside it" if "Fabric" in owner else
           "an optimizer_step override must call optimizer.step(closure=optimizer_closure) on the optimizer it is "
           "given, not optimizer.optimizer.step()")
    return (f"{owner}: the optimizer took a step the strategy did not drive, which the strategy cannot synchronize "
            f"(the ranks would drift apart; on one device its bases would not refresh): {fix}.")


def track_step_calls(optimizer: Optimizer, source: Optional[Optimizer] = None) -> Any:
    """Mark ``optimizer.step`` the way ``torch.optim.lr_scheduler.LRScheduler`` does (``_opt_called``,
    ``_wrapped_by_lr_sched``: torch's private flags; with ``SequentialLR``'s and ``ChainedScheduler``'s inner
    ``_schedulers``, read in this module, the private API outside ``lightning/_compat.py``), so that
    re-pointed schedulers do not warn that ``lr_scheduler.step()`` ran before ``optimizer.step()``. The step stays
    the optimizer's own (a ``functools.partial`` carries the mark; a hook notes the first step, and the caller
    removes it after that step with the handle returned: removed from inside torch's loop over the hooks, it broke
    the loop for any hook after it). ``source`` (the user's optimizer it was converted from) is marked too, for a
    scheduler that was not handed over."""
    step = functools.partial(type(optimizer).step, weakref.proxy(optimizer))  # no reference cycle, as torch's
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]

    def stepped(opt: Optimizer, args: Any, kwargs: Any) -> None:
        for marked in (opt, source) if source is not None else (opt,):
            marked._opt_called = True  # type: ignore[attr-defined]

    return optimizer.register_step_post_hook(stepped)


def several_optimizers_message(module: Any) -> str:
    """What to do when ``configure_optimizers`` returns more than one optimizer, or ``training_step`` takes
    ``optimizer_idx`` (Lightning refuses both under automatic optimization and suggests manual optimization,
    which the strategy refuses in turn)."""
    try:  # only on this error path: which optimizers were returned (configure_optimizers is called once more)
        found = _optimizers_in(module.configure_optimizers())
    except Exception:  # noqa: BLE001 (the message still says what to do)
        found = []
    names = ", ".join(type(o).__name__ for o in found)
    returned = f"{len(found)} optimizer{'s' if len(found) != 1 else ''} ({names})" if found else "several optimizers"
    if "optimizer_idx" in _hook_parameters(module, "training_step"):
        problem = (f"training_step takes `optimizer_idx` (Lightning 1.x's way of stepping several optimizers; "
                   f"configure_optimizers returned {returned})")
        drop = ", and remove `optimizer_idx` from training_step"
    else:
        problem, drop = f"configure_optimizers returned {returned}", ""
    return (
        f"LoRDOStrategy steps one optimizer under automatic optimization (not multiple optimizers), but {problem}. "
        "Lightning's suggestion, manual optimization, does not work with LoRDO either: it synchronizes after each "
        "optimizer step Lightning makes. Return one Adam/AdamW with a parameter group per part of the model, each "
        "with its own lr, betas and weight_decay, e.g. torch.optim.AdamW([{'params': self.encoder.parameters(), "
        "'lr': 1e-3}, {'params': self.head.parameters(), 'lr': 1e-4, 'betas': (0.9, 0.95)}]) (one LR scheduler "
        f"drives every group; LambdaLR takes one function per group){drop}. To keep several optimizers (e.g. a "
        "GAN's), use strategy='ddp'."
    )


def _optimizers_in(value: Any) -> list[Optimizer]:
    """The optimizers in what ``configure_optimizers`` returned (an optimizer, lists, tuples or dicts of them)."""
    if isinstance(value, Optimizer):
        return [value]
    if isinstance(value, dict):
        return _optimizers_in(value.get("optimizer"))
    if isinstance(value, (list, tuple)):
        return [o for item in value for o in _optimizers_in(item)]
    return []


def _hook_parameters(module: Any, name: str) -> list[str]:
    try:
        return list(inspect.signature(getattr(module, name)).parameters)
    except (AttributeError, TypeError, ValueError):
        return []
