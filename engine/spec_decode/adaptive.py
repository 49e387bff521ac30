"""Adaptive speculation: how many drafts (0..num_speculative_tokens) a request takes this step.

Two estimates, both measured rather than guessed:

- per request, its acceptance alpha: the chance a draft position is accepted given the ones
  before it were, as decayed counts (accepted drafts / positions tested; a step that accepts A
  of k drafts tested A + 1 positions, or k when all were accepted), starting optimistic;
- per engine (one device), the step cost: an online least-squares fit, with forgetting, of
  step seconds = a + b * tokens computed, over decode-only steps (the regime drafts live in).
  The real runner's steps are timed by the engine (scheduling, proposing, verifying included);
  the simulated runner gives its configured timing. Until the tokens per step have varied, b
  is 0 and every 4th step drafts nothing, so the fit gets plain steps to compare with.

The rule. A step of N decoding sequences computing T tokens costs a + b*T and makes about N
tokens, so one more token computed costs c = b*N / (a + b*T) of the tokens that time would make
at the step's rate. With k drafts at acceptance alpha a request emits
(1 - alpha^(k+1)) / (1 - alpha) tokens, so the j-th draft adds alpha^j expected tokens: take
drafts j = 1, 2, ... while alpha^j > margin * c (margin 1.5: only clear gains, since the
linear cost misses what a step with any verification pays once, and alpha is noisy). On a GPU (decode memory-bound, b tiny) c is
near 0 and k stays at its maximum; on a CPU (b large) only requests that accept well draft. At
batch 1 the rule is the latency rule (more tokens per second for that request); at larger
batches it is the throughput rule (the drafts add more tokens than their compute costs).

A request the rule stops (k = 0) learns nothing more, so it is re-probed with `probe_drafts`
drafts after enough proposals without drafting that probes cost about `probe_overhead` (2%)
of its steps' time: ceil(probe_drafts * c / probe_overhead) proposals, at least 4 (so few on a
GPU, more where drafts are dear), 2x sooner when its n-gram match is long (>= `long_match`, a
sign the answer now copies something). A probe that is accepted lifts its
alpha and the rule takes over again: a request that turns grounded later still gains. No
global state: the scheduler owns the cost model, each request its estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdaptiveConfig:
    prior_alpha: float = 0.8  # optimistic start: a new request drafts fully
    prior_weight: float = 2.0  # the prior counts as this many positions tested
    decay: float = 0.8  # per observation: the estimate follows the last ~5 verification steps
    margin: float = 1.5  # draft position j only while alpha^j > margin * cost ratio: a clear gain
    probe_drafts: int = 2  # drafts a probe takes (at most the proposal's)
    probe_overhead: float = 0.02  # probes of a request that rejects cost ~2% of its steps' time
    min_probe_interval: int = 4  # proposals without drafting before a probe, at least
    long_match: int = 3  # an n-gram match this long probes 2x sooner
    cost_decay: float = 0.99  # forgetting of the step-cost fit, per step observed
    min_token_variance: float = 0.25  # below this spread of tokens per step, keep the last slope
    explore_every: int = 4  # before the cost has a slope, every 4th step drafts nothing


@dataclass
class AcceptanceEstimate:
    """One request's acceptance, as decayed counts of accepted drafts and positions tested."""

    accepted: float
    tested: float
    proposals_since_draft: int = 0

    @classmethod
    def prior(cls, config: AdaptiveConfig) -> AcceptanceEstimate:
        return cls(config.prior_alpha * config.prior_weight, config.prior_weight)

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested if self.tested > 0 else 0.0

    def observe(self, num_drafts: int, num_accepted: int, decay: float) -> None:
        tested = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = decay * self.accepted + num_accepted
        self.tested = decay * self.tested + tested


@dataclass
class StepCostModel:
    """step seconds = a + b * tokens, fit online by least squares with forgetting. Until the
    tokens per step vary enough to give a slope, b is 0 (drafts look free: the optimistic
    start that makes them vary); afterwards a spread too small keeps the last slope."""

    decay: float = 0.99
    min_token_variance: float = 0.25
    a: float = 0.0
    b: float = 0.0
    n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    num_steps: int = 0
    has_slope: bool = False  # the tokens per step have varied enough, once, to fit b

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.n = d * self.n + 1
        self._sx = d * self._sx + tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + tokens * tokens
        self._sxy = d * self._sxy + tokens * seconds
        self.num_steps += 1
        mx, my = self._sx / self.n, self._sy / self.n
        var = self._sxx / self.n - mx * mx
        if var >= self.min_token_variance:
            self.b = max(0.0, (self._sxy / self.n - mx * my) / var)
            self.has_slope = True
        self.a = max(0.0, my - self.b * mx)

    def step_seconds(self, tokens: int) -> float:
        return self.a + self.b * tokens

    def draft_cost(self, num_seqs: int, num_tokens: int) -> float:
        """What one more token computed costs, in tokens of output the step makes: b*N / (a + b*T)."""
        total = self.step_seconds(num_tokens)
        return self.b * num_seqs / total if total > 0 else 0.0


def choose_k(alpha: float, k_max: int, cost: float, margin: float = 1.0) -> int:
    """The most drafts j <= k_max with alpha^j > margin * cost for every j (the j-th draft adds
    alpha^j expected tokens and costs `cost`)."""
    k, gain = 0, 1.0
    while k < k_max:
        gain *= alpha
        if gain <= margin * cost:
            break
        k += 1
    return k


@dataclass
class AdaptiveSpeculator:
    """The scheduler's: the step-cost model of its device and the rule."""

    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    cost: StepCostModel = field(init=False)
    num_steps: int = 0
    exploring: bool = False  # this step drafts nothing: the cost fit needs a plain step

    def __post_init__(self) -> None:
        self.cost = StepCostModel(self.config.cost_decay, self.config.min_token_variance)

    def begin_step(self) -> None:
        """A new step is being scheduled. Until the cost fit has a slope, every
        `explore_every`-th step drafts nothing (else an optimistic start that always drafts
        would never measure what drafting costs)."""
        self.num_steps += 1
        self.exploring = not self.cost.has_slope and self.num_steps % self.config.explore_every == 0

    def new_estimate(self) -> AcceptanceEstimate:
        return AcceptanceEstimate.prior(self.config)

    def num_drafts(
        self, est: AcceptanceEstimate, k_max: int, match_len: int, num_seqs: int, num_tokens: int
    ) -> int:
        """Drafts to take (0..k_max) for a request with a proposal of k_max tokens whose n-gram
        matched `match_len` tokens, in a step of about `num_seqs` sequences and `num_tokens`
        tokens so far."""
        cfg = self.config
        if self.exploring:
            return 0
        cost = self.cost.draft_cost(num_seqs, num_tokens)
        k = choose_k(est.alpha, k_max, cost, cfg.margin)
        if k > 0:
            est.proposals_since_draft = 0
            return k
        est.proposals_since_draft += 1
        if est.proposals_since_draft < self.probe_interval(cost, match_len):
            return 0
        est.proposals_since_draft = 0  # re-probe: the request may have turned grounded
        return min(k_max, cfg.probe_drafts)

    def probe_interval(self, cost: float, match_len: int) -> int:
        """Proposals without drafting before a probe: a probe costs probe_drafts * cost tokens'
        worth of time, spread over the interval's steps it is `probe_overhead` of them."""
        cfg = self.config
        interval = max(cfg.min_probe_interval, math.ceil(cfg.probe_drafts * cost / cfg.probe_overhead))
        return interval if match_len < cfg.long_match else max(cfg.min_probe_interval, interval // 2)

    def observe_acceptance(self, est: AcceptanceEstimate, num_drafts: int, num_accepted: int) -> None:
        est.observe(num_drafts, num_accepted, self.config.decay)

    def observe_step(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)
