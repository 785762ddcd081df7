"""SYNTHETIC speculative-decoding traces from a tiny deterministic draft/target pair (numpy, seeded).

* **target**: a 2-layer attention model with a per-layer KV cache over a 40-piece vocabulary (8 pieces are
  rare characters): ``logits = a * B[x] + gain * rmsnorm(h_L) @ W_u`` where ``h_L`` is the residual stream
  after the attention layers and ``a = max(0, cos(h_L, E[x]))`` is how clearly it still encodes the current
  token. The bigram table ``B`` keeps text plausible and rare pieces rare.
* **draft**: the target without attention (``B[x] + gain * rmsnorm(E[x]) @ W_u`` plus fixed noise), mixed with a
  prompt-lookup proposal whose weight grows with the length of the repeated suffix (as an n-gram / EAGLE
  draft that sees the target's own context).
* **verify**: speculative sampling with ``draft_tokens - 1`` drafts per step: accept draft ``d`` with
  probability ``min(1, p(d) / q(d))``, else sample the correction from ``max(p - q, 0)``; one bonus token
  when all drafts pass. Rejected positions are rolled back from the target's cache.

Regimes (``onset`` = generated tokens when the fault starts, drawn per request):

* ``healthy``: nothing injected. A share of them (``quote_fraction``) quote an earlier span of their own output
  verbatim, as code edits do; the draft's lookup predicts the quote well, so acceptance runs high for a while
  without anything being wrong (the case a repetition rule must not flag).
* ``garbled``: Gaussian noise (sigma drawn per request) is added to every cached K/V row of one target layer
  mid-generation, and to every row written into that layer afterwards (a transfer that keeps writing into
  reused slots). The residual stream stops encoding the current token, the target's prediction collapses
  towards near-uniform pieces (rare characters included) and the clean draft is rejected.
* ``repetition``: the target's attention degenerates into a copy of the token ``period`` positions back
  (a short cycle) which the draft's lookup also predicts, so nearly every draft is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COMMON = (" ", "e", "t", "a", "o", "n", "i", "s", "r", "h", "l", "d", "u", "c", "m", "p",
          " the", " and", "ing", "er", "on", "re", "st", "al", ".", ",", "\n", "(", ")", "=", "_", "0")
RARE = ("ǂ", "Ω", "ʬ", "☃", "ꙮ", "\ufffd", "ᚠ", "∯")
VOCAB = COMMON + RARE
REGIMES = ("healthy", "garbled", "repetition")


@dataclass(frozen=True)
class SynthConfig:
    draft_tokens: int = 4  # SGLang speculative_num_draft_tokens: 3 drafts per verify step
    max_new_tokens: int = 512
    prompt_tokens: int = 8
    d_model: int = 16
    n_layers: int = 2
    context_gain: float = 1.0
    temperature: tuple[float, float] = (0.6, 1.0)  # per request, uniform
    onset_tokens: tuple[int, int] = (32, 256)  # fault onset, generated tokens, uniform
    corrupt_layer: int = 1
    corrupt_sigma: tuple[float, float] = (2.0, 16.0)  # per request, uniform
    copy_gain: float = 12.0  # logit boost of the copied token (loops and quotes)
    loop_period: tuple[int, int] = (2, 6)
    quote_fraction: float = 0.25  # healthy requests that quote an earlier span verbatim (code edits, citations)
    quote_tokens: tuple[int, int] = (64, 320)  # quote length
    draft_noise: float = 0.6
    lookup_max: int = 8
    rare_logit: float = -4.0


@dataclass(frozen=True)
class SynthTrace:
    """One request: the label, per-step accepted drafts, the generated tokens, and the fault onset."""

    rid: str
    label: str
    draft_tokens: int
    accepted: tuple[int, ...]
    tokens: tuple[int, ...]
    onset_generated: int | None
    variant: str = ""  # "quote": a healthy request that repeats an earlier span of itself once

    @property
    def text(self) -> str:
        return decode(self.tokens)

    def accepted_after_onset(self) -> list[int]:
        """Accepted drafts of the verify steps that started at or after the onset (all steps if healthy)."""
        generated, out = 0, []
        for a in self.accepted:
            if generated >= (self.onset_generated or 0):
                out.append(a)
            generated += a + 1
        return out


def decode(tokens) -> str:
    return "".join(VOCAB[t] for t in tokens)


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class TinyPair:
    """Weights of the draft/target pair, drawn once from ``seed``."""

    def __init__(self, cfg: SynthConfig, seed: int) -> None:
        rng = np.random.default_rng(seed)
        v, d, n_common = len(VOCAB), cfg.d_model, len(COMMON)
        bigram = rng.normal(0.0, 1.0, (v, v))
        for row in bigram:  # a few likely successors per piece, rare pieces unlikely everywhere
            row[rng.choice(n_common, size=5, replace=False)] += rng.uniform(3.0, 5.0, size=5)
        bigram[:, n_common:] += cfg.rare_logit
        self.cfg, self.bigram = cfg, bigram
        self.embed = rng.normal(0.0, 1.0, (v, d))
        scale = 1.0 / np.sqrt(d)
        self.score_scale = scale
        self.embed_norm = np.sqrt((self.embed * self.embed).sum(-1, keepdims=True))
        self.wq, self.wk, self.wv, self.wo = (rng.normal(0.0, scale, (cfg.n_layers, d, d)) for _ in range(4))
        self.unembed = rng.normal(0.0, scale, (d, v))
        normed = self.embed / np.sqrt((self.embed * self.embed).mean(axis=-1, keepdims=True))
        self.draft_logits = bigram + cfg.context_gain * normed @ self.unembed
        self.draft_logits += rng.normal(0.0, cfg.draft_noise, (v, v))


class _Target:
    """The target with its per-layer KV cache; rows past ``n`` are tentative until :meth:`commit`."""

    def __init__(self, pair: TinyPair, capacity: int) -> None:
        self.p, cfg = pair, pair.cfg
        self.k = np.zeros((cfg.n_layers, capacity, cfg.d_model))
        self.v = np.zeros_like(self.k)
        self.n = 0
        self.copy: tuple[int, float] = (0, 0.0)  # (offset, end): predict seq[j - offset] for positions j < end
        self.noise: tuple[int, float, np.random.Generator] | None = None  # (layer, sigma, rng) once corrupted

    def forward(self, seq: list[int], m: int) -> np.ndarray:
        """Logits [m, V] after the last ``m`` tokens of ``seq``; writes their K/V rows tentatively."""
        p, n = self.p, self.n
        xs = np.asarray(seq[-m:])
        h = p.embed[xs]
        causal = np.triu(np.full((m, m), -np.inf), k=1)  # new query i sees cache rows 0..n+i
        for layer in range(p.cfg.n_layers):
            self.k[layer, n:n + m] = h @ p.wk[layer]
            self.v[layer, n:n + m] = h @ p.wv[layer]
            if self.noise and self.noise[0] == layer:  # the corruption keeps hitting rows written later
                self._add_noise(layer, n, n + m)
            scores = (h @ p.wq[layer]) @ self.k[layer, :n + m].T * p.score_scale
            scores[:, n:] += causal
            h = h + (_softmax(scores) @ self.v[layer, :n + m]) @ p.wo[layer]
        # The bigram knowledge is read from the residual stream: its weight is how clearly the final state
        # still encodes the current token (cosine with its embedding). Garbage from a corrupted cache washes
        # it out, and the prediction collapses towards the near-uniform context term (rare pieces included).
        norm = np.sqrt((h * h).sum(-1, keepdims=True))
        identity = np.clip((h * p.embed[xs]).sum(-1, keepdims=True) / (norm * p.embed_norm[xs]), 0, 1)
        h = h / (norm / np.sqrt(p.cfg.d_model) + 1e-6)  # final RMSNorm
        logits = identity * p.bigram[xs] + p.cfg.context_gain * (h @ p.unembed)
        offset, end = self.copy
        if offset:  # a copy head: a loop (offset = period, no end) or a healthy quote of an earlier span
            base = len(seq) - m + 1  # the position row 0 predicts
            rows = [i for i in range(m) if base + i < end]
            logits[rows, [seq[base + i - offset] for i in rows]] += p.cfg.copy_gain
        return logits

    def commit(self, rows: int) -> None:
        self.n += rows

    def corrupt(self, layer: int, sigma: float, rng: np.random.Generator) -> None:
        """Add N(0, sigma^2) to every cached K/V row of ``layer`` now and to every row written later."""
        self.noise = (layer, sigma, rng)
        self._add_noise(layer, 0, self.n)

    def _add_noise(self, layer: int, start: int, stop: int) -> None:
        _, sigma, rng = self.noise
        shape = (stop - start, self.k.shape[-1])
        self.k[layer, start:stop] += rng.normal(0.0, sigma, shape)
        self.v[layer, start:stop] += rng.normal(0.0, sigma, shape)


class _Draft:
    """Noisy context-free probabilities mixed with a prompt-lookup proposal: among the recent earlier
    occurrences of the last two tokens, the one whose preceding tokens match the context longest."""

    def __init__(self, pair: TinyPair, temperature: float) -> None:
        self.p = pair
        self.probs = _softmax(pair.draft_logits / temperature)  # [V, V], row = current token
        self.positions: dict[tuple[int, int], list[int]] = {}  # bigram -> indices of its 2nd token, oldest first

    def observe(self, seq: list[int], i: int) -> None:
        """Token ``seq[i]`` was committed: the bigram before it now has a known successor."""
        if i >= 2:
            self.positions.setdefault((seq[i - 2], seq[i - 1]), []).append(i - 1)

    def dist(self, ctx: list[int], committed: list[int]) -> np.ndarray:
        q = self.probs[ctx[-1]]
        best, best_match = None, 0
        for pos in reversed(self.positions.get((ctx[-2], ctx[-1]), ())[-8:]):
            match = 2
            while match < self.p.cfg.lookup_max and pos >= match and ctx[-1 - match] == committed[pos - match]:
                match += 1
            if match > best_match:
                best, best_match = pos, match
        if best is None:
            return q
        weight = 1.0 - 0.5 ** (best_match - 2)
        q = (1.0 - weight) * q
        q[committed[best + 1]] += weight
        return q


def _sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def generate(pair: TinyPair, regime: str, rid: str, seed: int | list[int]) -> SynthTrace:
    """Run speculative decoding for one request of ``regime`` until ``max_new_tokens`` are generated."""
    if regime not in REGIMES:
        raise ValueError(f"regime: expected one of {REGIMES}, got {regime!r}")
    cfg, rng = pair.cfg, np.random.default_rng(seed)
    temperature = rng.uniform(*cfg.temperature)
    onset = int(rng.integers(cfg.onset_tokens[0], cfg.onset_tokens[1] + 1))
    quote_len = int(rng.integers(cfg.quote_tokens[0], cfg.quote_tokens[1] + 1))
    quoting = regime == "healthy" and rng.random() < cfg.quote_fraction
    k = cfg.draft_tokens - 1
    target, draft = _Target(pair, cfg.prompt_tokens + cfg.max_new_tokens + k + 1), _Draft(pair, temperature)
    seq = [int(rng.integers(len(COMMON)))]
    while len(seq) < cfg.prompt_tokens:
        seq.append(_sample(_softmax(pair.bigram[seq[-1]] / temperature), rng))
    for i in range(len(seq)):
        draft.observe(seq, i)
    target.forward(seq[:-1], len(seq) - 1)  # prefill: cache rows for all prompt tokens but the last
    target.commit(len(seq) - 1)
    accepted_per_step, generated, onset_at = [], 0, None
    while generated < cfg.max_new_tokens:
        if onset_at is None and generated >= onset:
            onset_at = generated
            if regime == "garbled":
                target.corrupt(cfg.corrupt_layer, rng.uniform(*cfg.corrupt_sigma), rng)
            elif regime == "repetition":
                target.copy = (int(rng.integers(cfg.loop_period[0], cfg.loop_period[1] + 1)), np.inf)
            elif quoting:  # copy an earlier span verbatim, then go on normally
                length = min(quote_len, len(seq) - 1)
                source = int(rng.integers(0, len(seq) - length + 1))
                target.copy = (len(seq) - source, len(seq) + length)
        drafts, qs = [], []
        for _ in range(k):
            q = draft.dist(seq + drafts, seq)
            drafts.append(_sample(q, rng))
            qs.append(q)
        ps = _softmax(target.forward(seq + drafts, k + 1) / temperature)
        n_acc, extra = 0, None
        for j, d in enumerate(drafts):
            if rng.random() < min(1.0, ps[j, d] / qs[j][d]):
                n_acc += 1
                continue
            extra = _sample(np.maximum(ps[j] - qs[j], 0.0), rng)
            break
        if extra is None:
            extra = _sample(ps[k], rng)
        target.commit(n_acc + 1)
        for tok in drafts[:n_acc] + [extra]:
            seq.append(tok)
            draft.observe(seq, len(seq) - 1)
        accepted_per_step.append(n_acc)
        generated += n_acc + 1
    return SynthTrace(rid, regime, cfg.draft_tokens, tuple(accepted_per_step), tuple(seq[cfg.prompt_tokens:]),
                      None if regime == "healthy" else onset_at, "quote" if quoting else "")
