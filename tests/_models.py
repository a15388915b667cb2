"""Small Flax models shared by the tests, with hand-derived parameter counts."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

D, HIDDEN, VOCAB, LAYERS, OUT = 32, 64, 100, 3, 10

# Per block: up (D*HIDDEN + HIDDEN) + down (HIDDEN*D + D) + ln (2*D)
BLOCK_PARAMS = D * HIDDEN + HIDDEN + HIDDEN * D + D + 2 * D  # 4256
# embed (VOCAB*D) + LAYERS blocks (scanned, stacked) + ln_f (2*D) + head (D*OUT + OUT)
NET_PARAMS = VOCAB * D + LAYERS * BLOCK_PARAMS + 2 * D + D * OUT + OUT  # 16362


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(HIDDEN, name="up")(x)
        h = nn.Dense(D, name="down")(nn.gelu(h))
        return nn.LayerNorm(name="ln")(x + h), None


class Net(nn.Module):
    """Embed + scanned stack of blocks + LayerNorm + Dense head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, name="embed")(tokens)
        x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)(
            name="blocks"
        )(x, None)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(OUT, name="head")(x)


def init_net(seed=0):
    return Net().init(jax.random.key(seed), jnp.zeros((2, 5), jnp.int32))


class BoxedMLP(nn.Module):
    """Dense layers with FSDP / tensor-parallel partitioning names."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("fsdp", "tp")),
                     bias_init=nn.with_partitioning(nn.initializers.zeros, ("tp",)), name="in")(x)
        x = nn.LayerNorm(scale_init=nn.with_partitioning(nn.initializers.ones, (None,)),
                         bias_init=nn.with_partitioning(nn.initializers.zeros, (None,)), name="ln")(x)
        return nn.Dense(16, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("tp", "fsdp")),
                        bias_init=nn.with_partitioning(nn.initializers.zeros, (None,)), name="out")(x)


class DenseKernelsBoxed(nn.Module):
    """linen FSDP layout with *unboxed* biases (flax's default bias_init): kernels named, biases not."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "fsdp")), name="up")(x)
        return nn.Dense(8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("fsdp", None)),
                        name="down")(x)


# nnx: Linear(8->16, kernel named ("fsdp", None)) + BatchNorm(16) + Dropout(rngs) + Linear(16->4).
NNX_PARAMS = 8 * 16 + 16 + 2 * 16 + 16 * 4 + 4  # 244: kernels, biases, BatchNorm scale and bias
NNX_STATE = NNX_PARAMS + 2 * 16 + 1 + 1  # + BatchNorm mean/var (BatchStat), the Dropout's RngCount and RngKey


class NnxNet(nnx.Module):
    """An nnx Module with a named kernel, BatchNorm and a Dropout that holds its own Rngs stream.

    The named kernel needs a mesh (``jax.set_mesh``) or ``nnx.eval_shape`` to be created, as flax requires.
    """

    def __init__(self, rngs: nnx.Rngs, *, names=("fsdp", None)):
        kernel_init = nnx.initializers.lecun_normal()
        if names is not None:
            kernel_init = nnx.with_partitioning(kernel_init, names)
        self.up = nnx.Linear(8, 16, kernel_init=kernel_init, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.bn(self.up(x))))
