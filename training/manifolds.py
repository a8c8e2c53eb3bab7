"""Manifold operations for factored parameters, as small pure functions (float64-testable, no state).

A factored pair is two tall matrices L (m x r) and R (n x r) whose product X = L R^T is the matrix that matters (a LoRA
update B A, a metric generator W_U W_z, a head's W_Q^T W_K). The optimiser sees the Euclidean gradients of the loss
with respect to the factors, G_L = G R and G_R = G^T L (G = df/dX); everything below works from those, never from the
m x n matrix G.

Fixed-rank matrices (X of rank r, the factors free):
- quotient geometry (Mishra, Meyer, Bonnabel and Sepulchre, 2014): the factors modulo the GL(r) gauge, with the metric
  tr(R^T R dL^T dL) + tr(L^T L dR^T dR). Riemannian gradient (G_L (R^T R)^-1, G_R (L^T L)^-1): the gradients
  preconditioned by the factors' Gram matrices. Retraction: the straight step on the factors.
- embedded geometry: X on the manifold of rank-r m x n matrices, with the metric of R^{m x n}. Riemannian gradient:
  the projection of G onto the tangent space {U M V^T + U_p V^T + U V_p^T}, computed from the factor gradients.
  Retraction: the best rank-r approximation of X - t xi, from a 2r x 2r SVD, as balanced factors or, in the
  ``continuous_factors`` gauge, the factors of that X closest to the previous ones.

Partial isometries (orthonormal factors): each factor on its own manifold,
- Stiefel, Euclidean metric: grad = G - X sym(X^T G);
- Stiefel, canonical metric: grad = G - X G^T X;
- Grassmann-type quotient: (L, R) modulo O(r) acting jointly, (L Q, R Q) ~ (L, R), which leaves L R^T unchanged; the
  Stiefel gradient with its vertical part removed (``isometry_horizontal``), momentum kept horizontal;
each with a QR (sign-fixed) or polar retraction, and vector transport by projection onto the new tangent space.

Block variants (heads sharing a factor): one side of a pair may hold several factors, X = [L_1; ...; L_k] R^T
(block-rows: the heads' L_h share R) or X = L [R_1; ...; R_k]^T (block-columns). The fixed-rank geometries see the
stacked factors (the GL(r) gauge acts on every block at once, so their block step is the stacked step); the isometry
geometries keep each block orthonormal on its own Stiefel manifold, and Grassmann quotients by one O(r) for all blocks.
"""

import torch

# ----------------------------------------------------------------------------------------------------------------------
# small linear algebra
# ----------------------------------------------------------------------------------------------------------------------


def sym(a: torch.Tensor) -> torch.Tensor:
    return 0.5 * (a + a.transpose(-1, -2))


def qr_retract(y: torch.Tensor) -> torch.Tensor:
    """The Q factor of y (m x r) with a positive diagonal of R: a smooth retraction onto the Stiefel manifold."""
    q, r = torch.linalg.qr(y)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)  # why: a zero pivot has no sign; keep the column
    return q * signs.unsqueeze(-2)


def polar_retract(y: torch.Tensor) -> torch.Tensor:
    """The orthonormal polar factor U V^T of y = U S V^T: the Stiefel point closest to y in Frobenius norm."""
    u, _, vh = torch.linalg.svd(y, full_matrices=False)
    return u @ vh


RETRACTIONS = {"qr": qr_retract, "polar": polar_retract}


def gram_inverse(factor: torch.Tensor, damping: float) -> torch.Tensor:
    """(F^T F + delta I)^-1 for a tall factor F (k x r), delta = damping x mean eigenvalue (plus a floor): the quotient
    metric's preconditioner, regularised where the factor is rank deficient (LoRA's B starts at 0)."""
    gram = factor.transpose(-1, -2) @ factor  # (r, r)
    r = gram.shape[-1]
    scale = torch.diagonal(gram, dim1=-2, dim2=-1).mean()
    delta = damping * scale + torch.finfo(gram.dtype).eps
    eye = torch.eye(r, dtype=gram.dtype, device=gram.device)
    return torch.linalg.inv(gram + delta * eye)


# ----------------------------------------------------------------------------------------------------------------------
# fixed-rank matrices: quotient geometry
# ----------------------------------------------------------------------------------------------------------------------


def quotient_gradient(left, right, grad_left, grad_right, damping: float = 1e-8):
    """Riemannian gradient of the quotient geometry: (G_L (R^T R)^-1, G_R (L^T L)^-1)."""
    return grad_left @ gram_inverse(right, damping), grad_right @ gram_inverse(left, damping)


# ----------------------------------------------------------------------------------------------------------------------
# fixed-rank matrices: embedded geometry, tangent vectors as (U, V, M, U_p, V_p): xi = U M V^T + U_p V^T + U V_p^T
# ----------------------------------------------------------------------------------------------------------------------


def embedded_frame(left: torch.Tensor, right: torch.Tensor):
    """Orthonormal bases and core of X = L R^T: U (m x r), V (n x r), S (r x r) with X = U S V^T, and the triangular
    factors R_L, R_R (L = U R_L, R = V R_R)."""
    u, r_left = torch.linalg.qr(left)
    v, r_right = torch.linalg.qr(right)
    return u, v, r_left @ r_right.transpose(-1, -2), r_left, r_right


def is_full_rank(triangular: torch.Tensor, rtol: float = 1e-7) -> bool:
    diag = torch.diagonal(triangular, dim1=-2, dim2=-1).abs()
    return bool(diag.max() > 0 and diag.min() > rtol * diag.max())


def embedded_gradient(frame, grad_left, grad_right):
    """Projection of G onto the tangent space at X, from G_L = G R and G_R = G^T L: returns (M, U_p, V_p).

    G V = G_L R_R^-1 and G^T U = G_R R_L^-1 (the factors must be of full rank r)."""
    u, v, _, r_left, r_right = frame
    g_v = torch.linalg.solve_triangular(r_right, grad_left, upper=True, left=False)  # G_L R_R^-1 = G V: (m, r)
    gt_u = torch.linalg.solve_triangular(r_left, grad_right, upper=True, left=False)  # G_R R_L^-1 = G^T U: (n, r)
    m = u.transpose(-1, -2) @ g_v  # U^T G V: (r, r)
    return m, g_v - u @ m, gt_u - v @ m.transpose(-1, -2)


def tangent_to_dense(frame, tangent) -> torch.Tensor:
    """U M V^T + U_p V^T + U V_p^T as an m x n matrix (tests and small problems)."""
    u, v = frame[0], frame[1]
    m, u_p, v_p = tangent
    return u @ m @ v.transpose(-1, -2) + u_p @ v.transpose(-1, -2) + u @ v_p.transpose(-1, -2)


def tangent_factors(frame, tangent) -> tuple[torch.Tensor, torch.Tensor]:
    """A B^T = xi with A (m x 2r), B (n x 2r): a frame-free form of a tangent vector, to transport it."""
    u, v = frame[0], frame[1]
    m, u_p, v_p = tangent
    return torch.cat([u @ m + u_p, u], dim=-1), torch.cat([v, v_p], dim=-1)


def embedded_project(frame, a: torch.Tensor, b: torch.Tensor):
    """Projection of Z = A B^T onto the tangent space of ``frame``: (M, U_p, V_p). Used as the vector transport."""
    u, v = frame[0], frame[1]
    ut_a, bt_v = u.transpose(-1, -2) @ a, b.transpose(-1, -2) @ v  # (r, k), (k, r)
    m = ut_a @ bt_v
    u_p = (a - u @ ut_a) @ bt_v
    v_p = (b - v @ (v.transpose(-1, -2) @ b)) @ ut_a.transpose(-1, -2)
    return m, u_p, v_p


def embedded_retract(frame, tangent, step: float):
    """The best rank-r approximation of X + step * xi, returned as balanced factors (U' S'^1/2, V' S'^1/2).

    X + t xi = [U Q_u] [[S + t M, t R_v^T], [t R_u, 0]] [V Q_v]^T with U_p = Q_u R_u, V_p = Q_v R_v: a 2r x 2r SVD."""
    u, v, s = frame[0], frame[1], frame[2]
    m, u_p, v_p = tangent
    r = s.shape[-1]
    q_u, r_u = torch.linalg.qr(u_p)
    q_v, r_v = torch.linalg.qr(v_p)
    zeros = torch.zeros_like(s)
    core = torch.cat([torch.cat([s + step * m, step * r_v.transpose(-1, -2)], -1),
                      torch.cat([step * r_u, zeros], -1)], -2)  # (2r, 2r)
    uk, sigma, vkh = torch.linalg.svd(core)
    root = sigma[:r].sqrt()
    new_u = torch.cat([u, q_u], -1) @ uk[:, :r]
    new_v = torch.cat([v, q_v], -1) @ vkh[:r].transpose(-1, -2)
    return new_u * root, new_v * root


def continuous_factors(left: torch.Tensor, right: torch.Tensor, previous_left: torch.Tensor):
    """The same X = left right^T in the gauge nearest the previous left factor: (left A, right A^-T) with A (r x r)
    the least-squares solution of left A = previous_left.

    Why: where the model is not a function of X alone (RoPE turns W_Q and W_K's coordinates in pairs between the two
    factors; tanh follows a fibre code) the GL(r) gauge is not a symmetry, and the balanced factors of each retraction
    would turn the factors' coordinates by a step that the geometry did not ask for. Falls back to the balanced factors
    where A is not invertible (the new column space far from the old)."""
    a = torch.linalg.lstsq(left, previous_left).solution  # (r, r)
    if torch.linalg.matrix_rank(a) < a.shape[-1]:
        return left, right
    return left @ a, torch.linalg.solve(a, right.transpose(-1, -2)).transpose(-1, -2)  # right A^-T: (n, r)


# ----------------------------------------------------------------------------------------------------------------------
# partial isometries: Stiefel (Euclidean / canonical metric) and Grassmann
# ----------------------------------------------------------------------------------------------------------------------


def stiefel_project(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Orthogonal projection of z onto the tangent space of the Stiefel manifold at x: z - x sym(x^T z)."""
    return z - x @ sym(x.transpose(-1, -2) @ z)


def stiefel_euclidean_gradient(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return stiefel_project(x, g)


def stiefel_canonical_gradient(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Gradient under the canonical metric <a, b> = tr(a^T (I - x x^T / 2) b): g - x g^T x."""
    return g - x @ (g.transpose(-1, -2) @ x)  # why: this order is m r^2, not m^2 r


def isometry_horizontal(factors, directions):
    """Remove the vertical part of a tangent vector of a product of Stiefel manifolds for the quotient by O(r) acting
    on every factor at once, (F_1 Q, ..., F_k Q) ~ (F_1, ..., F_k), which leaves each product F_i F_j^T (a pair's
    partial isometry L R^T, or each block L_h R^T when heads share R) unchanged.

    The vertical space is {(F_i W)_i : W skew}; as every F_i is orthonormal, ||(F_i W)_i||^2 = k ||W||^2, so the
    orthogonal projection subtracts F_i W with W = skew(sum_i F_i^T xi_i) / k. After it, sum_i F_i^T xi_i is
    symmetric."""
    total = sum(f.transpose(-1, -2) @ xi for f, xi in zip(factors, directions))  # (r, r)
    omega = 0.5 * (total - total.transpose(-1, -2)) / len(factors)
    return [xi - f @ omega for f, xi in zip(factors, directions)]


# geometry -> (Riemannian gradient of one factor, projection onto its tangent space, joint horizontal projection)
ISOMETRY_GEOMETRIES = {
    "stiefel-euclidean": (stiefel_euclidean_gradient, stiefel_project, None),
    "stiefel-canonical": (stiefel_canonical_gradient, stiefel_project, None),
    "grassmann": (stiefel_euclidean_gradient, stiefel_project, isometry_horizontal),
}


def orthonormality_error(x: torch.Tensor) -> float:
    """max |x^T x - I|."""
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    return (x.transpose(-1, -2) @ x - eye).abs().max().item()
