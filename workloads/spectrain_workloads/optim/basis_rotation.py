"""BasisRotation: Adam run in the eigenbasis of the gradient second moments (SOAP-like).

For a rotated 2-D weight W [m, n] with gradient G [m, n] the optimizer keeps
    L  = EMA(X X^T)  [m, m]      R  = EMA(X^T X)  [n, n]      (X = G, or the momentum M: `source`)
    Q_L [m, m], Q_R [n, n]       orthonormal bases: eigenvectors of L and R (identity until the first refresh)
    M  [m, n]                    Adam's first moment, in the ordinary basis (projected every step)
    V~ [m, n]                    Adam's second moment, in the rotated basis
and steps
    G~ = Q_L^T G Q_R,  M~ = Q_L^T M Q_R,  V~ = b2 V~ + (1 - b2) G~^2
    W  = W (1 - lr wd) - lr Q_L ( (M~ / bc1) / (sqrt(V~ / bc2) + eps) ) Q_R^T      (bc: bias corrections)
Every `refresh_every` steps (>= 1, may be fractional: stage-aware shares; on average one refresh
per `refresh_every` steps) the bases are refreshed: a full `eigh` the first time, afterwards one
warm-started power-iteration step (Q <- QR(L Q)) with the columns ordered by their eigenvalue
estimate. V~ is then re-estimated in the new basis (`reproject`, see `_refresh_side`; it reduces to
SOAP's permutation of V~ when the refresh only reorders the basis, and keeps V~ meaningful when the
basis moves a lot: early in training, or the first eigh after `warmup_steps` of identity bases).
Momentum stays in the ordinary basis, so a basis change never invalidates it. `geometry` Unilateral rotates only the smaller side; a side larger than `max_dim`
is never rotated. Parameters in a group with `rotate=False` (and every non-2-D tensor) follow AdamW.
With identity bases the arithmetic is exactly torch.optim.AdamW's (same operations, same order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from spectrain_api.errors import ConfigError
from spectrain_api.names import BASIS_GEOMETRIES, BASIS_SOURCES, SECOND_MOMENT, UNILATERAL


def _check(field: str, ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {msg}")


def _refresh_due(since: int, every: float) -> bool:
    """Refresh at step `since` (0-based, after warm-up) of an interval `every` >= 1, which may be
    fractional (stage-aware shares): on average 1 / every refreshes per step, the first at 0. For an
    integer interval this is since % every == 0."""
    return since == 0 or math.floor(since / every) != math.floor((since - 1) / every)


class BasisRotation(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        refresh_every: float = 10,
        warmup_steps: int = 0,
        geometry: str = "Bilateral",
        source: str = "SecondMoment",
        basis_beta: float = 0.95,
        max_dim: int = 4096,
        rotate: bool = True,
        reproject: bool = True,
    ) -> None:
        base = "spec.target.optimizer"
        _check(f"{base}.lr", lr > 0, f"must be > 0, got {lr}")
        _check(f"{base}.basisRotation.refreshEvery", refresh_every >= 1, f"must be >= 1, got {refresh_every!r}")
        _check(f"{base}.basisRotation.geometry", geometry in BASIS_GEOMETRIES,
               f"{geometry!r} is not one of {list(BASIS_GEOMETRIES)}")
        _check(f"{base}.basisRotation.source", source in BASIS_SOURCES, f"{source!r} is not one of {list(BASIS_SOURCES)}")
        _check("betas", all(0.0 <= b < 1.0 for b in betas), f"each beta must be in [0, 1), got {betas}")
        _check("basis_beta", 0.0 <= basis_beta < 1.0, f"must be in [0, 1), got {basis_beta}")
        _check("eps", eps >= 0, f"must be >= 0, got {eps}")
        _check("weight_decay", weight_decay >= 0, f"must be >= 0, got {weight_decay}")
        _check("warmup_steps", warmup_steps >= 0, f"must be >= 0, got {warmup_steps}")
        _check("max_dim", max_dim >= 1, f"must be >= 1, got {max_dim}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, refresh_every=refresh_every,
                        warmup_steps=warmup_steps, geometry=geometry, source=source, basis_beta=basis_beta,
                        max_dim=max_dim, rotate=rotate, reproject=reproject)
        super().__init__(params, defaults)

    # ---- per-parameter state ---------------------------------------------------------------

    @staticmethod
    def _sides(p: torch.Tensor, group: dict[str, Any]) -> tuple[bool, bool]:
        """Which sides of p [m, n] are rotated: (left, right)."""
        if not group["rotate"] or p.dim() != 2:
            return False, False
        m, n = p.shape
        if group["geometry"] == UNILATERAL:
            left, right = m <= n, n < m
        else:
            left, right = True, True
        return left and m <= group["max_dim"], right and n <= group["max_dim"]

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        left, right = self._sides(p, group)
        st: dict[str, Any] = {
            "step": 0,
            "refreshes": 0,
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),      # M  [m, n]
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),   # V~ [m, n]
        }
        for side, on, d in (("left", left, p.shape[0]), ("right", right, p.shape[-1])):
            if on:
                st[f"stat_{side}"] = torch.zeros(d, d, dtype=torch.float32, device=p.device)  # L or R [d, d]
                st[f"basis_{side}"] = torch.eye(d, dtype=torch.float32, device=p.device)      # Q_L or Q_R
        return st

    # ---- rotations -------------------------------------------------------------------------

    @staticmethod
    def _to_rotated(x: torch.Tensor, st: dict[str, Any]) -> torch.Tensor:
        """Q_L^T x Q_R for x [m, n] (identity on sides that are not rotated)."""
        if "basis_left" in st:
            x = st["basis_left"].T.to(x.dtype) @ x
        if "basis_right" in st:
            x = x @ st["basis_right"].to(x.dtype)
        return x

    @staticmethod
    def _from_rotated(x: torch.Tensor, st: dict[str, Any]) -> torch.Tensor:
        """Q_L x Q_R^T for x [m, n]."""
        if "basis_left" in st:
            x = st["basis_left"].to(x.dtype) @ x
        if "basis_right" in st:
            x = x @ st["basis_right"].T.to(x.dtype)
        return x

    @staticmethod
    def _refresh_side(st: dict[str, Any], side: str, reproject: bool) -> None:
        """Refresh Q_L (side 'left', rows of V~) or Q_R ('right', columns of V~), and carry V~ over.

        V~ is re-estimated in the new basis: with C = Q_old^T Q_new [d, d] (old directions a, new
        directions i), the variance along new direction i is sum_a C[a, i]^2 V~[a, ...] (exact for
        independent rotated coordinates; preserves the total; a pure permutation when the basis only
        reorders). `reproject=False` keeps SOAP's rule: V~ is only permuted with the sorted columns.
        """
        stat, q = st[f"stat_{side}"], st[f"basis_{side}"]                  # [d, d], [d, d]
        if st["refreshes"] == 0:                                           # first time: full eigh
            eye = torch.eye(stat.shape[0], dtype=torch.float64, device=stat.device)
            _, vecs = torch.linalg.eigh(stat.double() + 1e-12 * eye)      # ascending eigenvalues
            new_q = vecs.flip(-1).float()                                  # descending
            order = None
        else:                                                              # warm-started power iteration
            est = (q * (stat @ q)).sum(0)                                  # [d] eigenvalue estimates diag(Q^T L Q)
            order = torch.argsort(est, descending=True)
            new_q, _ = torch.linalg.qr(stat @ q[:, order])
        v = st["exp_avg_sq"]                                               # V~ [m, n]
        if reproject:
            c2 = (q.T @ new_q).square().to(v.dtype)                        # C∘C [d, d], columns sum to 1
            st["exp_avg_sq"] = (c2.T @ v if side == "left" else v @ c2).contiguous()
        elif order is not None:                                            # keep V~ aligned with the columns
            st["exp_avg_sq"] = (v[order] if side == "left" else v[:, order]).contiguous()
        st[f"basis_{side}"] = new_q.contiguous()

    # ---- step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad                                                 # G [m, n]
                st = self.state[p]
                if not st:
                    st.update(self._init_state(p, group))
                st["step"] += 1
                t = st["step"]
                m = st["exp_avg"]
                m.lerp_(g, 1 - b1)                                         # M: ordinary basis
                rotated = "basis_left" in st or "basis_right" in st
                if rotated:
                    x = (g if group["source"] == SECOND_MOMENT else m).float()
                    if "stat_left" in st:
                        st["stat_left"].lerp_(x @ x.T, 1 - group["basis_beta"])   # L [m, m]
                    if "stat_right" in st:
                        st["stat_right"].lerp_(x.T @ x, 1 - group["basis_beta"])  # R [n, n]
                    since = t - 1 - group["warmup_steps"]
                    if since >= 0 and _refresh_due(since, group["refresh_every"]):
                        for side in ("left", "right"):
                            if f"basis_{side}" in st:
                                self._refresh_side(st, side, group.get("reproject", True))
                        st["refreshes"] += 1
                    g = self._to_rotated(g, st)                            # G~
                    m = self._to_rotated(m, st)                            # M~
                v = st["exp_avg_sq"]
                v.mul_(b2).addcmul_(g, g, value=1 - b2)                    # V~
                p.mul_(1 - lr * wd)                                        # decoupled weight decay
                bc1 = 1 - b1**t
                bc2_sqrt = math.sqrt(1 - b2**t)
                denom = (v.sqrt() / bc2_sqrt).add_(eps)
                if rotated:
                    p.add_(self._from_rotated(m * (-lr / bc1) / denom, st))
                else:
                    p.addcdiv_(m, denom, value=-lr / bc1)
        return loss
