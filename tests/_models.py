"""Small Flax models shared by the tests, with hand-derived parameter counts."""

import flax.linen as nn
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
