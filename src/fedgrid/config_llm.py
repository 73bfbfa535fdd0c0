"""The keys of federated fine-tuning with adapters (``--peft lora:...``), a group that
``fedgrid.config.Config`` inherits (``fedgrid.config_values.key``), and the parser of the ``peft`` spec.

``peft = "lora:r=8,alpha=16,targets=q_proj,v_proj"`` wraps a ``--model hf:PATH`` in LoRA adapters
(the ``peft`` library, ``fedgrid[llm]``): the base model stays frozen on every side and only the
adapters travel. ``lora_aggregation`` says how the coordinator merges them (``LORA_AGGREGATIONS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedgrid.aggregation.lora import LORA_AGGREGATIONS
from fedgrid.config_values import key as _key
from fedgrid.errors import ConfigError

__all__ = [
    "LlmKeys",
    "LoraSpec",
    "LORA_AGGREGATIONS",
    "LORA_KEYS",
    "parse_peft",
    "parse_peft_ranks",
    "peft_at_rank",
    "peft_rank_bound",
    "check_llm_keys",
]

#: The keys of a ``lora:`` spec.
LORA_KEYS = ("r", "alpha", "targets", "dropout")


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter: rank ``r``, scaling ``alpha / r``, on the linear layers whose names end in
    one of ``targets``, with ``dropout`` on their inputs."""

    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def _number(spec: str, name: str, text: str, kind: type) -> float:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError("peft", f"{spec!r}: {name} must be a {kind.__name__}, got {text!r}") from None


def parse_peft(spec: str) -> LoraSpec | None:
    """The adapter ``spec`` names: ``""`` (none), ``lora`` (the defaults) or
    ``lora:r=8,alpha=16,targets=q_proj,v_proj,dropout=0.05`` (any subset; ``targets`` takes the
    comma-separated names up to the next ``KEY=``).

    Raises:
        ConfigError: another adapter kind, an unknown key, a bad number, r < 1, alpha <= 0, a dropout
            outside [0, 1), or no targets (names ``peft``).
    """
    if not spec:
        return None
    kind, _, body = spec.partition(":")
    if kind != "lora":
        raise ConfigError(
            "peft", f"unknown adapter {kind!r}: expected lora or lora:r=8,alpha=16,targets=q_proj,v_proj"
        )
    values: dict[str, str] = {}
    targets: list[str] = []
    last = ""
    for item in filter(None, (part.strip() for part in body.split(","))):
        name, sep, value = item.partition("=")
        if not sep and last == "targets":
            targets.append(item)
            continue
        if not sep or name.strip() not in LORA_KEYS:
            raise ConfigError(
                "peft", f"{spec!r}: expected KEY=VALUE with KEY one of {', '.join(LORA_KEYS)}, got {item!r}"
            )
        last = name.strip()
        if last == "targets":
            targets = [value.strip()] if value.strip() else []
        else:
            values[last] = value.strip()
    r = int(_number(spec, "r", values.get("r", "8"), int))
    alpha = _number(spec, "alpha", values.get("alpha", str(r * 2)), float)
    dropout = _number(spec, "dropout", values.get("dropout", "0"), float)
    if r < 1:
        raise ConfigError("peft", f"{spec!r}: r must be at least 1, got {r}")
    if not alpha > 0 or alpha == float("inf"):
        raise ConfigError("peft", f"{spec!r}: alpha must be positive and finite, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError("peft", f"{spec!r}: dropout must be in [0, 1), got {dropout}")
    chosen = tuple(targets) if "targets" in body else LoraSpec.targets
    if not chosen:
        raise ConfigError("peft", f"{spec!r}: targets names no module (e.g. targets=q_proj,v_proj)")
    return LoraSpec(r=r, alpha=alpha, targets=chosen, dropout=dropout)


def parse_peft_ranks(text: str, bound: int) -> tuple[int, ...]:
    """The clients' LoRA ranks ``peft_rank`` names: ``""`` (the coordinator's ``bound``), ``R``
    (every client) or ``R1,R2,...`` (client ``i`` takes item ``i`` mod their count).

    Raises:
        ConfigError: an item that is not an integer, or outside ``[1, bound]`` (names ``peft_rank``).
    """
    if not text.strip():
        return ()
    ranks = []
    for item in (part.strip() for part in text.split(",")):
        try:
            rank = int(item)
        except ValueError:
            raise ConfigError(
                "peft_rank", f"{text!r}: expected R or R1,R2,... (integers), got {item!r}"
            ) from None
        if not 1 <= rank <= bound:
            raise ConfigError("peft_rank", f"{rank} is outside [1, {bound}] (the peft rank r bounds it)")
        ranks.append(rank)
    return tuple(ranks)


def peft_rank_bound(peft: str) -> int:
    """The rank ``r`` of the adapters ``peft`` names (0 without): the highest a client may train."""
    spec = parse_peft(peft)
    return spec.r if spec is not None else 0


def peft_at_rank(peft: str, peft_rank: str, index: int) -> str:
    """The ``peft`` spec of client ``index`` under ``peft_rank`` (``parse_peft_ranks``): rank
    ``r_i`` with ``alpha = r_i * alpha / r``, so that every side keeps the scale ``alpha / r``
    (``fedgrid.aggregation.lora_ranks``); ``peft`` itself without a rank of its own."""
    spec = parse_peft(peft)
    ranks = parse_peft_ranks(peft_rank, spec.r if spec else 0) if peft_rank.strip() else ()
    if spec is None or not ranks or ranks[index % len(ranks)] == spec.r:
        return peft
    rank = ranks[index % len(ranks)]
    return f"lora:r={rank},alpha={spec.scaling * rank!r},dropout={spec.dropout!r},targets={','.join(spec.targets)}"


@dataclass(frozen=True)
class LlmKeys:
    """Language-model fine-tuning with adapters: the adapter, how it is aggregated, and the client's
    training options for a causal LM."""

    peft: str = _key(
        "adapters on a --model hf:PATH: lora or lora:r=8,alpha=16,targets=q_proj,v_proj,dropout=0 (the peft "
        "library, fedgrid[llm]); the base stays frozen and only the adapters travel",
        "",
    )
    lora_aggregation: str | None = _key(
        "with peft: factors (average A and B, the default), svd (average the products B.A, refactorize by "
        "truncated SVD to rank r; fedavg and fedprox) or ffa (A frozen at its seeded start, B trained)",
        None,
    )
    peft_rank: str = _key(
        "with peft: the clients' own LoRA ranks, R (every client) or R1,R2,... (client i takes item i mod "
        "their count), each in [1, r]; a rank other than r needs lora_aggregation = svd, which sends each "
        "client the model refactorized to its rank",
        "",
    )
    grad_accum: int = _key(
        "language-model clients: micro-batches per optimizer step (the gradient of batch_size examples, the "
        "activations of batch_size / grad_accum)",
        1,
    )
    grad_checkpointing: bool = _key(
        "--model hf:PATH clients: gradient (activation) checkpointing, less memory for more compute", False
    )


def check_llm_keys(
    peft: str, lora_aggregation: str | None, aggregator: str | None, model: str, peft_rank: str = ""
) -> None:
    """Checks the adapter keys together.

    Raises:
        ConfigError: a bad ``peft`` spec, ``peft`` on a model that is not ``hf:PATH``, an unknown
            ``lora_aggregation``, one without ``peft``, ``svd`` with a robust ``aggregator``, a
            bad ``peft_rank``, one without ``peft``, or ranks other than r without ``svd``.
    """
    spec = parse_peft(peft)
    if spec is not None and not model.startswith("hf:"):
        raise ConfigError(
            "peft", f"adapters wrap a Hugging Face model: set --model hf:PATH (model is {model!r})"
        )
    if peft_rank.strip() and spec is None:
        raise ConfigError("peft_rank", "applies to adapters only: set peft (e.g. --peft lora:r=8)")
    if spec is not None and lora_aggregation != "svd":
        if any(rank != spec.r for rank in parse_peft_ranks(peft_rank, spec.r)):
            raise ConfigError(
                "lora_aggregation",
                f"{lora_aggregation or 'factors'} averages factors of one shape: clients of LoRA ranks "
                f"{peft_rank} beside r={spec.r} need lora_aggregation = svd",
            )
    elif spec is not None:
        parse_peft_ranks(peft_rank, spec.r)
    if lora_aggregation is None:
        return
    if lora_aggregation not in LORA_AGGREGATIONS:
        raise ConfigError(
            "lora_aggregation", f"unknown value {lora_aggregation!r} (known: {', '.join(LORA_AGGREGATIONS)})"
        )
    if spec is None:
        raise ConfigError("lora_aggregation", "applies to adapters only: set peft (e.g. --peft lora:r=8)")
    if lora_aggregation == "svd" and aggregator not in (None, "mean"):
        raise ConfigError(
            "lora_aggregation",
            f"svd averages the products itself: it takes no robust aggregator ({aggregator})",
        )
