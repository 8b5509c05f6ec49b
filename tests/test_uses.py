"""zeroflax.sharding.uses: where a program uses each parameter, read from its jaxpr (issue 42).

Abstract traces only (no compilation): each case is a model written the way its authors write it, and
the uses found must be the ones its code makes, in its order, per iteration where a loop scans a stack.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from zeroflax.sharding.uses import parameter_uses, uses_by_leaf, uses_in_jaxpr


def _paths(params) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _named(uses, params) -> dict[str, list]:
    paths = _paths(params)
    return {paths[leaf]: found for leaf, found in uses_by_leaf(uses).items()}


def _plain_params():
    rng = np.random.default_rng(0)
    return {"embedding": jnp.asarray(rng.normal(size=(11, 8)), jnp.float32),
            "layers": {"w": jnp.asarray(rng.normal(size=(3, 8, 8)), jnp.float32),
                       "b": jnp.zeros((3, 8), jnp.float32)},
            "scale": jnp.ones((8,), jnp.float32)}


def _plain_loss(params, tokens):
    """A pure-JAX language model as Levanter or Equinox users write one: a lookup, a plain `lax.scan`
    over stacked layers, and a head tied to the embedding through `.T`."""
    h = params["embedding"][tokens]

    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None

    h, _ = lax.scan(layer, h, params["layers"])
    logits = (h * params["scale"]) @ params["embedding"].T
    return jax.nn.logsumexp(logits, axis=-1).mean()


def test_a_plain_scan_uses_each_layer_per_iteration_and_the_tied_head_at_its_use():
    params = _plain_params()
    uses = _named(parameter_uses(_plain_loss, params, jnp.zeros((2, 5), jnp.int32)), params)
    embedding = uses["['embedding']"]
    # The lookup (integer ids: a gather) first, the tied head (a matmul on the transpose) last.
    assert [u.primitive for u in embedding] == ["gather", "dot_general"]
    assert not any(u.loops for u in embedding)
    for leaf in ("['layers']['w']", "['layers']['b']"):
        assert uses[leaf] and all(u.per_iteration and u.loops == ("scan",) and u.inside == ("scan",)
                                  for u in uses[leaf]), uses[leaf]
    # Program order: the lookup, then every layer, then the scale and the head.
    order = [u.order for u in (embedding[0], uses["['layers']['w']"][0], uses["['scale']"][0], embedding[1])]
    assert order == sorted(order)
    assert all(u.source.startswith(__file__.rsplit("/", 1)[-1]) or __file__ in u.source for u in embedding), embedding


def test_weight_only_code_is_no_use_until_it_meets_the_data():
    """`w.T`, a cast, a scale by a constant and a sum of two weights are weight views: the use is the
    matmul that takes the view and the data, one per leaf behind it."""
    def loss(params, x):
        w = (params["a"].T.astype(jnp.bfloat16) * 2 + params["b"].T.astype(jnp.bfloat16))
        return (x.astype(jnp.bfloat16) @ w).sum()

    params = {"a": jnp.ones((3, 4)), "b": jnp.ones((3, 4))}
    uses = parameter_uses(loss, params, jnp.ones((2, 4)))
    assert [(u.leaf, u.primitive) for u in uses] == [(0, "dot_general"), (1, "dot_general")]
    assert uses[0].order == uses[1].order


def test_a_weight_returned_or_reduced_alone_is_used_at_the_output():
    """A regulariser over the weights only never meets the data: it is used where the program ends."""
    uses = parameter_uses(lambda p, x: (x * 0).sum() + 1e-4 * jnp.sum(p["w"] ** 2), {"w": jnp.ones(3)},
                          jnp.ones(3))
    assert [u.primitive for u in uses] == ["add"]  # the data's loss plus the weights' own term


def test_a_stack_read_by_index_inside_fori_loop_is_used_whole_at_every_iteration():
    """`fori_loop` over `stack[i]`: the loop gets the whole stack as a constant. That is what the
    analysis must say (gathering it there would gather every layer at every iteration)."""
    def loss(params, x):
        def body(i, h):
            return jnp.tanh(h @ params["w"][i])
        return lax.fori_loop(0, 3, body, x).sum()

    uses = parameter_uses(loss, {"w": jnp.ones((3, 4, 4))}, jnp.ones((2, 4)))
    assert uses and all(u.whole_in_loop for u in uses), uses


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.tanh(nn.Dense(8, name="dense")(h)), None


class _ScannedModel(nn.Module):
    """An `nn.scan` whose stacked axis is named nothing in particular ('blocks', not 'layers')."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(11, 8, name="embed")
        h = embed(tokens)
        stack = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        h, _ = stack(name="blocks")(h, None)
        return embed.attend(h)


def test_an_nn_scan_of_any_name_and_a_tied_attend():
    model = _ScannedModel()
    tokens = jnp.zeros((2, 5), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    uses = _named(parameter_uses(lambda p, t: model.apply({"params": p}, t).sum(), params, tokens), params)
    assert [u.primitive for u in uses["['embed']['embedding']"]][-1] == "dot_general"  # attend: the tied head
    assert len(uses["['embed']['embedding']"]) == 2
    for leaf in ("['blocks']['dense']['kernel']", "['blocks']['dense']['bias']"):
        assert uses[leaf] and all(u.per_iteration for u in uses[leaf]), uses[leaf]


def test_nnx_methods_beside_call():
    nnx = pytest.importorskip("flax.nnx")

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(11, 8, rngs=rngs)
            self.mlp = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, tokens):
            return self.embed.attend(nnx.relu(self.mlp(self.embed(tokens))))

    graphdef, state = nnx.split(Tied(nnx.Rngs(0)))
    params = nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state

    def loss(p, tokens):
        if hasattr(nnx, "replace_by_pure_dict"):
            st = jax.tree.map(lambda x: x, state)
            nnx.replace_by_pure_dict(st, p)
        else:
            st = p
        return nnx.merge(graphdef, st)(tokens).sum()

    uses = _named(parameter_uses(loss, params, jnp.zeros((2, 5), jnp.int32)), params)
    embedding = next(v for k, v in uses.items() if "embedding" in k)
    assert [u.primitive for u in embedding] == ["gather", "dot_general"]


def test_transformers_gpt2_tied_head_is_two_uses_at_each_end():
    """transformers' FlaxGPT2LMHeadModel: `wte.embedding` is used by the lookup at the start and by the
    LM head (`wte.embedding.T` as a Dense kernel) at the end, with every block's uses in between."""
    from real_model_cases import case

    gpt2 = case("hf_gpt2")
    params = gpt2.variables["params"]
    batch = gpt2.batches[0]
    uses = parameter_uses(lambda p, b: gpt2.loss(p, b, None), params, batch)
    named = _named(uses, params)
    wte = named["['transformer']['wte']['embedding']"]
    assert len(wte) == 2 and wte[0].primitive != "dot_general" and wte[1].primitive == "dot_general"
    every_other = [u.order for path, found in named.items() if "wte" not in path for u in found]
    assert wte[0].order < min(every_other) < max(every_other) < wte[1].order


def test_uses_in_jaxpr_reads_parameters_at_any_input_position():
    closed = jax.make_jaxpr(lambda x, w: (x @ w).sum())(jnp.ones((2, 3)), jnp.ones((3, 4)))
    uses = uses_in_jaxpr(closed, {1: 7})
    assert [(u.leaf, u.primitive) for u in uses] == [(7, "dot_general")]


def test_a_use_inside_a_custom_vjp_names_the_calls_around_it():
    """A gather group is a custom_vjp: a use inside one says so, and so does one inside a jit inside a
    checkpoint (how the engine tells a use inside a group from one outside any)."""
    @jax.custom_vjp
    def block(w, x):
        return x @ w

    block.defvjp(lambda w, x: (x @ w, (w, x)), lambda res, g: (res[1].T @ g, g @ res[0].T))

    def loss(params, x):
        h = block(params["a"], x)
        return jax.checkpoint(jax.jit(lambda h: (h @ params["b"]).sum()))(h)

    uses = parameter_uses(loss, {"a": jnp.ones((3, 3)), "b": jnp.ones((3, 2))}, jnp.ones((2, 3)))
    assert [u.leaf for u in uses] == [0, 1]
    assert uses[0].inside[0].startswith("custom_vjp") and not uses[0].loops
    assert len(uses[1].inside) == 2 and "jit" in uses[1].inside[1] and "jit" not in uses[1].inside[0], uses[1]
