"""AcceRL ablation G.4: PPO-clip against GIPO on gymnasium MuJoCo under a forced policy lag.

Single process per run, no Ray: a state-based MLP actor (diagonal Gaussian, state-independent
log-std) and a separate MLP critic, trained PPO-style (cleanRL's MuJoCo recipe: batches of
``--rollout`` x ``--envs`` = 2048 steps, ``--epochs`` 10 passes of shuffled minibatches,
advantages normalised per minibatch, Adam at 3e-4 annealed linearly to 0, running observation
normalisation and reward scaling, both clipped to +-10; unlike cleanRL no value clipping, and
minibatches of 256 rather than 64: a quarter of the gradient steps, three times the env steps
per second on a CPU, where the updates of 64 took two thirds of the time). Only the policy loss
changes between methods: relayrl's ``ppo_clip_loss`` (``ppo``, clip 0.2) or ``gipo_loss``
(``gipo<sigma>``, the paper's symmetric form, neg_ratio 1.0), each step's log-prob summed over
the action dimensions counting as one token.

The lag: the rollout batch of update k is collected by the learner's actor as it was K =
``--lag`` updates earlier (min(k, K) for the first K), kept in a deque of K + 1 state dicts, and
its log-probs are the losses' ``mu_logp``, as a relayrl sampler's are. Values, GAE (relayrl's
``gae``, each env's steps cut into segments at episode ends; time limits bootstrap from the final
observation) and value targets come from the current critic. ``--lag 0`` is plain PPO.

A run's score is the mean undiscounted return of ``--eval-episodes`` deterministic episodes
(the Gaussian's mean action, observation statistics frozen) of the final actor, normalised per
env as (return - random) / (expert - random) with D4RL's constants (``REFERENCE``). Per method,
the IQM and mean of the normalised scores over every (env, seed) run, with 95% percentile CIs
from a stratified bootstrap (seeds resampled within each env, ``--bootstrap`` resamples), as
rliable computes them (Agarwal et al. 2021, arXiv:2108.13264).

    python experiments/acce_g4.py --steps 20000 --envs-list Hopper-v5 --methods ppo --seeds 0
    python experiments/acce_g4.py --steps 100000 --seeds 0 1 2 --jobs 2

It writes ``experiments/results/acce_g4.json`` and ``.png`` (learning curves per env and the IQM
per method, with the command line and machine) after every finished run, so a killed sweep keeps
what finished, and prints a Markdown table for ``docs/benchmarks.md`` at the end. The finished
JSON keeps each run's means of its per-update health traces; the traces go to
``experiments/results/steps/acce_g4.json.gz``, outside git.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import matplotlib

matplotlib.use("Agg")  # benchmark machines have no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import provenance, relative, save_result, write_steps  # noqa: E402

from relayrl.algorithms.advantages import gae  # noqa: E402
from relayrl.algorithms.losses import LossFn, gipo_loss, ppo_clip_loss  # noqa: E402

NAME = "acce_g4"
# (random, expert) returns from D4RL's d4rl/infos.py REF_MIN_SCORE / REF_MAX_SCORE (Fu et al.
# 2020, arXiv:2004.07219), measured on the mujoco-py -v2 envs. The -v5 envs keep the same reward
# terms and weights, so the scale carries over, but not to the last digit.
REFERENCE = {
    "Hopper-v5": (-20.272305, 3234.3),
    "HalfCheetah-v5": (-280.178953, 12135.0),
    "Walker2d-v5": (1.629008, 4592.3),
}
CLIP = 10.0  # bound on normalised observations and scaled rewards, as cleanRL's wrappers
CURVE_WINDOW = 10  # training episodes the learning curve averages
PER_UPDATE = ("clip_frac", "ess", "kl_mu_pi", "ess_start", "kl_mu_pi_start")  # traces, per update


class RunningMeanStd:
    """Running mean and variance of a stream of batches (Chan et al.'s parallel update)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.mean = np.zeros(shape)
        self.var = np.ones(shape)
        self.count = 1e-4  # as gymnasium's, so the first batch dominates the prior

    def update(self, batch: np.ndarray) -> None:
        """Fold in a batch whose first axis indexes samples."""
        mean, var, count = batch.mean(0), batch.var(0), batch.shape[0]
        delta, total = mean - self.mean, self.count + count
        self.mean = self.mean + delta * count / total
        m2 = self.var * self.count + var * count + delta**2 * self.count * count / total
        self.var, self.count = m2 / total, total

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """``x`` standardised by the running statistics and clipped, as float32."""
        return np.clip((x - self.mean) / np.sqrt(self.var + 1e-8), -CLIP, CLIP).astype(np.float32)


def layer(n_in: int, n_out: int, std: float = 2**0.5) -> nn.Linear:
    """A linear layer with cleanRL's orthogonal initialisation."""
    linear = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.zeros_(linear.bias)
    return linear


class Actor(nn.Module):
    """Diagonal Gaussian policy: an MLP mean and a state-independent log-std."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.mean = nn.Sequential(
            layer(obs_dim, hidden),
            nn.Tanh(),
            layer(hidden, hidden),
            nn.Tanh(),
            layer(hidden, act_dim, std=0.01),
        )
        self.log_std = nn.Parameter(torch.zeros(act_dim))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Normal:
        """The action distribution at each observation of [B, obs_dim]."""
        mean = self.mean(obs)
        return torch.distributions.Normal(mean, self.log_std.exp().expand_as(mean))


def critic_net(obs_dim: int, hidden: int) -> nn.Sequential:
    """The value MLP, [B, obs_dim] -> [B, 1]."""
    return nn.Sequential(
        layer(obs_dim, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(), layer(hidden, 1, 1.0)
    )


def method_loss(method: str) -> tuple[LossFn, dict[str, float]]:
    """The policy loss and its keyword arguments for ``ppo`` or ``gipo<sigma>``."""
    if method == "ppo":
        return ppo_clip_loss, {"clip_eps": 0.2}
    if method.startswith("gipo"):
        return gipo_loss, {"sigma": float(method.removeprefix("gipo")), "neg_ratio": 1.0}
    raise ValueError(f"unknown method {method!r}: ppo or gipo<sigma>")


def segment_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: np.ndarray,
    done: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and value targets of a [T, N] rollout through relayrl's segment ``gae``.

    ``next_values[t, i]`` is V of the observation after step t (the final one where the episode
    ended); ``done`` marks episode ends and ``terminated`` the ones a time limit did not cause.
    """
    steps, n = rewards.shape
    # relayrl's gae takes rows that never span two episodes, so each env's column is cut at
    # its episode ends and at the rollout's end, where the row bootstraps from next_values.
    rows = []
    for i in range(n):
        first = 0
        for t in range(steps):
            if done[t, i] or t == steps - 1:
                rows.append((i, first, t + 1))
                first = t + 1
    seg_rewards = torch.zeros(len(rows), steps)
    seg_values = torch.zeros(len(rows), steps + 1)
    seg_mask = torch.zeros(len(rows), steps, dtype=torch.bool)
    seg_terminated = torch.zeros(len(rows), dtype=torch.bool)
    for b, (i, first, end) in enumerate(rows):
        length = end - first
        seg_rewards[b, :length] = rewards[first:end, i]
        seg_values[b, :length] = values[first:end, i]
        seg_values[b, length] = next_values[end - 1, i]
        seg_mask[b, :length] = True
        seg_terminated[b] = bool(terminated[end - 1, i])
    seg_adv, seg_ret = gae(seg_rewards, seg_values, seg_terminated, seg_mask, gamma=gamma, lam=lam)
    advantages, returns = torch.zeros(steps, n), torch.zeros(steps, n)
    for b, (i, first, end) in enumerate(rows):
        advantages[first:end, i] = seg_adv[b, : end - first]
        returns[first:end, i] = seg_ret[b, : end - first]
    return advantages, returns


def evaluate(
    actor: Actor, obs_rms: RunningMeanStd, env_id: str, episodes: int, seed: int
) -> list[float]:
    """Undiscounted returns of deterministic episodes (the mean action) with frozen statistics."""
    env = gym.make(env_id)
    low, high = env.action_space.low, env.action_space.high
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                mean = actor.mean(torch.from_numpy(obs_rms.normalize(obs[None])))
            obs, reward, terminated, truncated, _ = env.step(np.clip(mean[0].numpy(), low, high))
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return returns


def train_run(task: tuple[str, str, int, dict]) -> dict:
    """Train one (env, method, seed) run with the lagged behaviour policy; its record."""
    env_id, method, seed, cfg = task
    start = time.time()
    torch.set_num_threads(1)
    # Argument checks on every Normal cost more than the small MLPs' forward passes.
    torch.distributions.Distribution.set_default_validate_args(False)
    torch.manual_seed(seed)
    loss_fn, loss_kwargs = method_loss(method)
    n, t_len, lag = cfg["envs"], cfg["rollout"], cfg["lag"]
    gamma, lam = cfg["gamma"], cfg["lam"]
    envs = [gym.make(env_id) for _ in range(n)]
    obs_dim = envs[0].observation_space.shape[0]
    act_dim = envs[0].action_space.shape[0]
    low, high = envs[0].action_space.low, envs[0].action_space.high
    actor, critic = Actor(obs_dim, act_dim, cfg["hidden"]), critic_net(obs_dim, cfg["hidden"])
    behaviour = copy.deepcopy(actor)
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = torch.optim.Adam(params, lr=cfg["lr"], eps=1e-5, foreach=True)
    history = deque([copy.deepcopy(actor.state_dict())], maxlen=lag + 1)
    obs_rms, ret_rms = RunningMeanStd((obs_dim,)), RunningMeanStd(())
    raw = np.stack([env.reset(seed=seed * 1000 + i)[0] for i, env in enumerate(envs)])
    for i, env in enumerate(envs):
        env.action_space.seed(seed * 1000 + i)
    obs_rms.update(raw)
    discounted, ep_return = np.zeros(n), np.zeros(n)
    episodes: list[float] = []
    curve, health, lags = [], [], []
    n_updates = max(cfg["steps"] // (n * t_len), 1)
    frames = 0
    for update in range(n_updates):
        optimizer.param_groups[0]["lr"] = cfg["lr"] * (1.0 - update / n_updates)
        behaviour.load_state_dict(history[0])
        lags.append(len(history) - 1)
        obs = np.zeros((t_len, n, obs_dim), dtype=np.float32)
        next_obs = np.zeros_like(obs)
        actions = torch.zeros(t_len, n, act_dim)
        mu_logp = torch.zeros(t_len, n)
        rewards = np.zeros((t_len, n), dtype=np.float32)
        terminated = np.zeros((t_len, n), dtype=bool)
        done = np.zeros((t_len, n), dtype=bool)
        for t in range(t_len):
            obs[t] = obs_rms.normalize(raw)
            with torch.no_grad():
                dist = behaviour.dist(torch.from_numpy(obs[t]))
                action = dist.sample()
                mu_logp[t] = dist.log_prob(action).sum(-1)
            actions[t] = action
            clipped = np.clip(action.numpy(), low, high)
            final, fresh, reward = np.empty_like(raw), np.empty_like(raw), np.zeros(n)
            for i, env in enumerate(envs):
                o, r, term, trunc, _ = env.step(clipped[i])
                reward[i], final[i], fresh[i] = r, o, o
                ep_return[i] += r
                terminated[t, i], done[t, i] = term, term or trunc
                if done[t, i]:
                    episodes.append(float(ep_return[i]))
                    ep_return[i] = 0.0
                    fresh[i] = env.reset()[0]
            frames += n
            if cfg["reward_scale"]:
                # cleanRL's NormalizeReward: divide by the running std of the discounted return.
                discounted = discounted * gamma + reward
                ret_rms.update(discounted)
                reward = np.clip(reward / np.sqrt(ret_rms.var + 1e-8), -CLIP, CLIP)
                discounted[done[t]] = 0.0
            rewards[t] = reward
            obs_rms.update(fresh)
            next_obs[t] = obs_rms.normalize(final)
            raw = fresh
        with torch.no_grad():
            values = critic(torch.from_numpy(obs)).squeeze(-1)
            next_values = critic(torch.from_numpy(next_obs)).squeeze(-1)
        advantages, returns = segment_gae(
            torch.from_numpy(rewards), values, next_values, terminated, done, gamma, lam
        )
        batch = {
            "obs": torch.from_numpy(obs).flatten(0, 1),
            "actions": actions.flatten(0, 1),
            "mu_logp": mu_logp.flatten(),
            "advantages": advantages.flatten(),
            "returns": returns.flatten(),
        }
        health.append(learn(actor, critic, optimizer, loss_fn, loss_kwargs, batch, cfg))
        history.append(copy.deepcopy(actor.state_dict()))
        recent = episodes[-CURVE_WINDOW:]
        curve.append([frames, float(np.mean(recent)) if recent else None])
    for env in envs:
        env.close()
    eval_returns = evaluate(actor, obs_rms, env_id, cfg["eval_episodes"], 10**6 + seed * 100)
    score = float(np.mean(eval_returns))
    last = episodes[-CURVE_WINDOW:]
    return {
        "env": env_id,
        "method": method,
        "seed": seed,
        "score": score,
        "normalized": normalize_score(env_id, score),
        "eval_returns": eval_returns,
        "train_last_return": float(np.mean(last)) if last else None,
        "episodes": len(episodes),
        "env_steps": frames,
        "updates": n_updates,
        "lag_mean": float(np.mean(lags)),
        "clip_frac": [h["clip_frac"] for h in health],
        "ess": [h["ess"] for h in health],
        "kl_mu_pi": [h["kl_mu_pi"] for h in health],
        "ess_start": [h["ess_start"] for h in health],
        "kl_mu_pi_start": [h["kl_mu_pi_start"] for h in health],
        "clip_frac_mean": float(np.mean([h["clip_frac"] for h in health])),
        "ess_mean": float(np.mean([h["ess"] for h in health])),
        "ess_start_mean": float(np.mean([h["ess_start"] for h in health])),
        "curve": curve,
        "wall_s": time.time() - start,
    }


def learn(
    actor: Actor,
    critic: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    loss_kwargs: dict[str, float],
    batch: dict[str, torch.Tensor],
    cfg: dict,
) -> dict[str, float]:
    """``epochs`` passes of shuffled minibatches; the loss metrics averaged over them."""
    count = batch["advantages"].shape[0]
    sums: dict[str, float] = {}
    start: dict[str, float] = {}
    steps = 0
    for _ in range(cfg["epochs"]):
        order = torch.randperm(count)
        for first in range(0, count, cfg["minibatch"]):
            idx = order[first : first + cfg["minibatch"]]
            dist = actor.dist(batch["obs"][idx])
            logp = dist.log_prob(batch["actions"][idx]).sum(-1, keepdim=True)
            adv = batch["advantages"][idx]
            adv = ((adv - adv.mean()) / (adv.std() + 1e-8)).unsqueeze(-1)
            mu = batch["mu_logp"][idx].unsqueeze(-1)
            policy_loss, metrics = loss_fn(logp, mu, adv, torch.ones_like(logp), **loss_kwargs)
            value = critic(batch["obs"][idx]).squeeze(-1)
            value_loss = 0.5 * (value - batch["returns"][idx]).square().mean()
            loss = policy_loss + cfg["vf_coef"] * value_loss
            loss = loss - cfg["entropy"] * dist.entropy().sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_([*actor.parameters(), *critic.parameters()], 0.5)
            optimizer.step()
            for key in ("clip_frac", "ess", "kl_mu_pi", "ratio_mean"):
                sums[key] = sums.get(key, 0.0) + metrics[key]
            if not start:
                # Before this update's first step, pi is the learner the lag left behind mu.
                start = {f"{key}_start": metrics[key] for key in ("ess", "kl_mu_pi")}
            steps += 1
    return {**{key: value / steps for key, value in sums.items()}, **start}


def normalize_score(env_id: str, score: float) -> float:
    """``score`` on the D4RL scale: 0 a random policy, 1 the expert."""
    random, expert = REFERENCE[env_id]
    return (score - random) / (expert - random)


def iqm(scores: np.ndarray) -> float:
    """Interquartile mean: the mean of the middle half, int(n / 4) cut from each end."""
    ordered = np.sort(scores)
    cut = len(ordered) // 4
    return float(ordered[cut : len(ordered) - cut].mean())


def mean(scores: np.ndarray) -> float:
    """The plain mean, as a float."""
    return float(np.mean(scores))


def stratified_ci(
    by_env: list[np.ndarray],
    stat: Callable[[np.ndarray], float],
    resamples: int,
    rng: np.random.Generator,
) -> tuple[float, float, float]:
    """``stat`` of all scores and its 95% percentile CI from a bootstrap stratified by env."""
    point = stat(np.concatenate(by_env))
    draws = np.empty(resamples)
    for r in range(resamples):
        # Each env keeps its number of runs, so a resample never shifts weight between envs.
        draws[r] = stat(np.concatenate([s[rng.integers(0, len(s), len(s))] for s in by_env]))
    low, high = np.percentile(draws, [2.5, 97.5])
    return point, float(low), float(high)


def aggregate(runs: list[dict], methods: list[str], resamples: int, seed: int = 0) -> dict:
    """Per method, IQM and mean of the normalised scores with stratified-bootstrap CIs."""
    rng = np.random.default_rng(seed)
    out = {}
    for method in methods:
        envs = sorted({r["env"] for r in runs if r["method"] == method})
        by_env = [
            np.array([r["normalized"] for r in runs if r["method"] == method and r["env"] == e])
            for e in envs
        ]
        if not by_env:
            continue
        iqm_point, iqm_low, iqm_high = stratified_ci(by_env, iqm, resamples, rng)
        mean_point, mean_low, mean_high = stratified_ci(by_env, mean, resamples, rng)
        out[method] = {
            "iqm": iqm_point,
            "iqm_ci": [iqm_low, iqm_high],
            "mean": mean_point,
            "mean_ci": [mean_low, mean_high],
            "runs": int(sum(len(s) for s in by_env)),
        }
    return out


def per_env(runs: list[dict], methods: list[str], envs: list[str]) -> list[dict]:
    """Mean and std over seeds of each (env, method)'s final return and normalised score."""
    rows = []
    for env in envs:
        for method in methods:
            mine = [r for r in runs if r["env"] == env and r["method"] == method]
            if not mine:
                continue
            scores = np.array([r["score"] for r in mine])
            normed = np.array([r["normalized"] for r in mine])
            rows.append(
                {
                    "env": env,
                    "method": method,
                    "runs": len(mine),
                    "return_mean": float(scores.mean()),
                    "return_std": float(scores.std()),
                    "normalized_mean": float(normed.mean()),
                    "normalized_std": float(normed.std()),
                    "clip_frac_mean": float(np.mean([r["clip_frac_mean"] for r in mine])),
                    "ess_mean": float(np.mean([r["ess_mean"] for r in mine])),
                    "ess_start_mean": float(np.mean([r["ess_start_mean"] for r in mine])),
                }
            )
    return rows


def plot(result: dict, out_png: Path) -> Path:
    """Learning curves per env (mean over seeds) and the IQM with its CI per method."""
    envs, methods = result["args"]["envs_list"], result["args"]["methods"]
    fig, axes = plt.subplots(1, len(envs) + 1, figsize=(4.2 * (len(envs) + 1), 4))
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    for ax, env in zip(axes, envs, strict=False):
        for method in methods:
            curves = [
                r["curve"] for r in result["runs"] if r["env"] == env and r["method"] == method
            ]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            x = [c[0] for c in curves[0][:length]]
            # A run has no point before its first finished episode; average the runs that do.
            y = [
                np.mean([c[k][1] for c in curves if c[k][1] is not None] or [np.nan])
                for k in range(length)
            ]
            ax.plot(x, y, color=colors[method], label=f"{method} ({len(curves)})")
        ax.set_title(env, fontsize=9)
        ax.set_xlabel("env steps")
        ax.set_ylabel(f"training return (last {CURVE_WINDOW} episodes)")
        if ax.lines:
            ax.legend(fontsize=7)
    ax = axes[-1]
    agg = result["aggregate"]
    shown = [m for m in methods if m in agg]
    for k, method in enumerate(shown):
        a = agg[method]
        err = [[a["iqm"] - a["iqm_ci"][0]], [a["iqm_ci"][1] - a["iqm"]]]
        ax.errorbar(k, a["iqm"], yerr=err, fmt="o", color=colors[method], capsize=5)
        ax.plot(k + 0.15, a["mean"], "x", color=colors[method])
    ax.set_xticks(range(len(shown)), shown)
    ax.set_ylabel("normalised score: IQM (o, 95% CI), mean (x)")
    ax.set_title(
        f"lag {result['args']['lag']} updates, {result['args']['steps']} steps", fontsize=9
    )
    fig.suptitle(result["command"], fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def table(result: dict) -> str:
    """The Markdown tables: the aggregate per method, then mean +- std per env and method."""
    rows = ["| method | IQM [95% CI] | mean [95% CI] | runs |", "|---|---|---|---|"]
    for method, a in result["aggregate"].items():
        rows.append(
            f"| {method} | {a['iqm']:.3f} [{a['iqm_ci'][0]:.3f}, {a['iqm_ci'][1]:.3f}] "
            f"| {a['mean']:.3f} [{a['mean_ci'][0]:.3f}, {a['mean_ci'][1]:.3f}] | {a['runs']} |"
        )
    rows += [
        "",
        "| env | method | return | normalised | clip_frac | ESS | ESS at start | runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["per_env"]:
        rows.append(
            f"| {r['env']} | {r['method']} | {r['return_mean']:.0f} +- {r['return_std']:.0f} "
            f"| {r['normalized_mean']:.3f} +- {r['normalized_std']:.3f} "
            f"| {r['clip_frac_mean']:.3f} | {r['ess_mean']:.3f} | {r['ess_start_mean']:.3f} "
            f"| {r['runs']} |"
        )
    return "\n".join(rows)


def tasks(args: argparse.Namespace) -> list[tuple[str, str, int, dict]]:
    """Every (env, method, seed) run, the methods of one (env, seed) adjacent and rotated."""
    cfg = {k: v for k, v in vars(args).items() if k not in ("out",)}
    order = []
    for seed in args.seeds:
        for e, env in enumerate(args.envs_list):
            # Adjacent runs share the machine's load, and rotating who goes first keeps any
            # start-of-sweep or end-of-sweep effect off a single method.
            shift = (seed + e) % len(args.methods)
            for method in args.methods[shift:] + args.methods[:shift]:
                order.append((env, method, seed, cfg))
    return order


def main(argv: list[str] | None = None) -> int:
    """Run the sweep with ``--jobs`` workers; write the result files after every run."""
    args = parse_args(argv)
    for method in args.methods:
        method_loss(method)
    for env in args.envs_list:
        if env not in REFERENCE:
            raise SystemExit(f"no normalisation constants for {env}: {sorted(REFERENCE)}")
    todo = tasks(args)
    result = {
        "benchmark": NAME,
        **provenance(),
        "args": {k: relative(str(v)) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "reference": {env: list(REFERENCE[env]) for env in args.envs_list},
        "score": f"mean return of {args.eval_episodes} deterministic episodes of the final actor",
        "runs": [],
    }
    start = time.time()
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch state
    with ctx.Pool(args.jobs) as pool:
        for run in pool.imap_unordered(train_run, todo, chunksize=1):
            result["runs"].append(run)
            result["wall_clock_s"] = time.time() - start
            result["complete"] = len(result["runs"]) == len(todo)
            result["aggregate"] = aggregate(result["runs"], args.methods, args.bootstrap)
            result["per_env"] = per_env(result["runs"], args.methods, args.envs_list)
            train = run["train_last_return"]
            train = float("nan") if train is None else train
            print(
                f"[{len(result['runs'])}/{len(todo)}] {run['env']} {run['method']} seed "
                f"{run['seed']}: eval {run['score']:.0f} (norm {run['normalized']:.3f}), "
                f"train {train:.0f}, "
                f"clip_frac {run['clip_frac_mean']:.3f}, ESS {run['ess_mean']:.3f}, "
                f"{run['wall_s']:.0f} s ({run['env_steps'] / run['wall_s']:.0f} steps/s)",
                flush=True,
            )
            if not result["complete"]:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
                plot(result, args.out / f"{args.name}.png")
    write_steps(args.out, args.name, result)
    save_result(args.out, args.name, summarise(result), plot, table(result))
    print(f"wall clock {result['wall_clock_s']:.0f} s", file=sys.stderr)
    return 0


def summarise(result: dict) -> dict:
    """What the JSON in git keeps: ``result`` without each run's per-update health traces (their
    means stay; the traces go to the steps dump)."""
    runs = [
        {key: value for key, value in run.items() if key not in PER_UPDATE}
        for run in result["runs"]
    ]
    return result | {"runs": runs}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs-list", nargs="+", default=list(REFERENCE))
    parser.add_argument("--methods", nargs="+", default=["ppo", "gipo0.2", "gipo0.5", "gipo1.0"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100_000, help="env steps per run")
    parser.add_argument("--lag", type=int, default=4, help="updates the behaviour policy trails")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one thread each")
    parser.add_argument("--envs", type=int, default=8, help="envs per run")
    parser.add_argument("--rollout", type=int, default=256, help="steps per env per update")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--minibatch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--vf-coef", type=float, default=0.5)
    parser.add_argument("--entropy", type=float, default=0.0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--no-reward-scale", dest="reward_scale", action="store_false")
    parser.add_argument("--eval-episodes", type=int, default=5)
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--name", default=NAME, help="result file name")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
