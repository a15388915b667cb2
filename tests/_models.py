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


# linen nn.scan with the `layers` partition name (MaxText-style logical names): embed + decoder(scanned
# `layers` of up/down Dense with unboxed biases, then an unboxed LayerNorm `norm`).
SCAN_LAYERS, SCAN_D, SCAN_VOCAB = 4, 16, 32
# embed (VOCAB*D) + layers (L * (D*2D + 2D + 2D*D + D)) + norm (2*D)
SCAN_PARAMS = SCAN_VOCAB * SCAN_D + SCAN_LAYERS * (4 * SCAN_D * SCAN_D + 3 * SCAN_D) + 2 * SCAN_D  # 4832


def scan_rules(layers_axis=None):
    """Logical -> mesh axis rules: `layers` replicated (None) or split over ``layers_axis``; FSDP on `mlp`/`vocab`."""
    return (("layers", layers_axis), ("mlp", "fsdp"), ("vocab", "fsdp"), ("embed", None))


class _ScanBlock(nn.Module):
    rules: tuple

    @nn.compact
    def __call__(self, x, _):
        init = nn.initializers.normal(1.0)
        # Kernels boxed with logical names; biases left unboxed (flax's default bias_init), stacked all the same.
        h = nn.Dense(2 * SCAN_D, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp"), rules=self.rules),
                     name="up")(x)
        h = nn.Dense(SCAN_D, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed"), rules=self.rules),
                     name="down")(nn.gelu(h))
        return x + h, None


class _ScanDecoder(nn.Module):
    rules: tuple

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=SCAN_LAYERS,
                       metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = scan(self.rules, name="layers")(x, None)
        return nn.LayerNorm(name="norm")(x)  # unboxed, not stacked


class ScannedLM(nn.Module):
    """Embed + a decoder whose blocks are one ``nn.scan`` with ``metadata_params={nn.PARTITION_NAME: "layers"}``."""

    rules: tuple = scan_rules()

    @nn.compact
    def __call__(self, tokens):
        embed_init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"), rules=self.rules)
        x = nn.Embed(SCAN_VOCAB, SCAN_D, embedding_init=embed_init, name="embed")(tokens)
        return _ScanDecoder(self.rules, name="decoder")(x)
