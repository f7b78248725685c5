"""Data-parallel training of a small NumPy MLP on scikit-learn's digits (shipped with scikit-learn, no
download), with gflow as the gradient transport: dense, dense fp16, or CSC (SparseAllreduce).

Used by bench/convergence.py (curves and a plot) and tests/test_convergence.py (the accuracy check).
Every rank starts from the same weights and walks the same global batches; rank r computes the mean
loss gradient over its share of each batch, and the transport averages the ranks' gradients, so the
global batch is the same at every world size.
"""

import numpy as np

HIDDEN = 256
CHUNK_ELEMS = 32  # 64*256 + 256 + 256*10 + 10 = 19,210 parameters: 601 chunks of 32


def load(seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def init(seed: int = 0):
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((64, HIDDEN)).astype(np.float32) * np.float32(np.sqrt(2 / 64))
    w2 = rng.standard_normal((HIDDEN, 10)).astype(np.float32) * np.float32(np.sqrt(2 / HIDDEN))
    return np.concatenate([w1.ravel(), np.zeros(HIDDEN, np.float32), w2.ravel(), np.zeros(10, np.float32)])


def _unpack(theta):
    a, b = 64 * HIDDEN, 64 * HIDDEN + HIDDEN
    c = b + HIDDEN * 10
    return theta[:a].reshape(64, HIDDEN), theta[a:b], theta[b:c].reshape(HIDDEN, 10), theta[c:]


def gradient(theta, x, y):
    """Mean cross-entropy gradient over (x, y), flat like theta."""
    w1, b1, w2, b2 = _unpack(theta)
    h = np.maximum(x @ w1 + b1, 0)
    logits = h @ w2 + b2
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    p /= len(y)
    dh = (p @ w2.T) * (h > 0)
    return np.concatenate([(x.T @ dh).ravel(), dh.sum(0), (h.T @ p).ravel(), p.sum(0)]).astype(np.float32)


def accuracy(theta, x, y) -> float:
    w1, b1, w2, b2 = _unpack(theta)
    return float(np.mean(np.argmax(np.maximum(x @ w1 + b1, 0) @ w2 + b2, axis=1) == y))


def train(variant: str, comm, epochs: int = 30, batch: int = 64, lr: float = 0.1, density: float = 0.01):
    """Train with one transport; returns the held-out accuracy after each epoch.

    variant: "dense" (allreduce, SGD with momentum 0.9), "fp16" (the same, float16 on the wire) or
    "csc" (SparseAllreduce at `density` with momentum correction 0.5 and 2 epochs of warm-up, plain
    SGD on its update, as Deep Gradient Compression does). CSC's momentum is 0.5, not 0.9: chunks wait
    about 1/density steps between sends, and a residual built with 0.9 arrives as a step too large
    for this small model (tried: accuracy fell after the warm-up, recovering only late).
    """
    import gflow

    (xtr, ytr), (xte, yte) = load()
    theta = init()
    velocity = np.zeros_like(theta)
    steps_per_epoch = len(ytr) // batch
    csc = None
    if variant == "csc":
        csc = gflow.SparseAllreduce(density=density, chunk_elems=CHUNK_ELEMS, momentum=0.5,
                                    warmup_steps=2 * steps_per_epoch, comm=comm)  # fmt: skip
    order = np.random.default_rng(1)
    curve = []
    for _ in range(epochs):
        perm = order.permutation(len(ytr))
        for s in range(steps_per_epoch):
            idx = perm[s * batch : (s + 1) * batch][comm.rank :: comm.size]  # this rank's share
            g = gradient(theta, xtr[idx], ytr[idx])
            if variant == "csc":
                theta -= lr * csc(g)
            else:
                g = gflow.allreduce(g, "mean", comm=comm, compression="fp16" if variant == "fp16" else None)
                velocity = 0.9 * velocity + g
                theta -= lr * velocity
        curve.append(accuracy(theta, xte, yte))
    return curve
