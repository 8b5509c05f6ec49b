"""Gather groups formed in program order (zeroflax/sharding/program_groups.py), read off a jaxpr: which
equations join the group that starts at a use, and where it stops. The engine's side (names, equality
with plain JAX, the bucket's meaning) is tests/test_zero3_models.py's
test_program_order_groups_follow_prefetch_bucket_size."""
import jax
import jax.numpy as jnp

from zeroflax.sharding.program_groups import form_group, last_reads

ELEMENTS = {0: 10, 1: 10, 2: 10, 3: 10}


@jax.custom_vjp
def marked_block(x):  # stands for a group traced already (a Flax module, a zeroflax.group)
    return jnp.sin(x)


marked_block.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


def loss(a, b, c, d, x):
    h = jnp.tanh(x @ a)              # a use, then data
    h = h @ b.T                      # a weight view (b.T), then a use
    h = jnp.exp(h)                   # data after the last use: left outside the group
    h = jax.lax.scan(lambda carry, _: (carry @ c, None), h, None, length=2)[0]  # c read whole by a loop
    h = marked_block(h) @ d
    return jnp.sum(h)


def _jaxpr():
    v = jnp.ones((4, 4))
    return jax.make_jaxpr(loss)(v, v, v, v, v).jaxpr


def _group(jaxpr, start, bucket):
    lazy = {var: (i,) for i, var in enumerate(jaxpr.invars[:4])}
    return form_group(jaxpr.eqns, start, lazy, ELEMENTS.get, bucket, alone=lambda eqn, leaves: False)


def test_a_group_takes_the_uses_that_fit_and_the_data_between_them():
    jaxpr = _jaxpr()
    start = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general")
    group = _group(jaxpr, start, bucket=20)
    names = [e.primitive.name for e in group.body]
    assert names == ["dot_general", "tanh", "dot_general"], names
    assert [e.primitive.name for e in group.views] == ["transpose"]
    assert group.leaves == (0, 1) and group.uses == 2
    # It stops after its last use: the exp and the scan reading c are not in it.
    assert jaxpr.eqns[group.end].primitive.name == "exp"
    outputs = [v for e in group.body for v in e.outvars if last_reads(jaxpr).get(v, -1) >= group.end]
    assert len(outputs) == 1  # only the second matmul's result is read after the group


def test_a_group_never_takes_more_than_its_bucket_nor_a_group_traced_already():
    jaxpr = _jaxpr()
    start = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general")
    assert _group(jaxpr, start, bucket=15) is None  # a's use alone: the pass's group of one equation
    assert _group(jaxpr, start, bucket=0) is None
    # With room for every leaf, the group still stops before the loop (c) and the custom_vjp.
    group = _group(jaxpr, start, bucket=1000)
    assert group.leaves == (0, 1), group.leaves
    assert all(e.primitive.name not in ("scan", "custom_vjp_call", "custom_vjp_call_jaxpr") for e in group.body)


def test_a_group_never_starts_at_a_weight_view():
    """A view computed before any use (`b.T` first) stays lazy: the group starts at the use reading it."""
    def early_view(a, b, c, d, x):
        bt = b.T
        return jnp.sum(jnp.tanh(x @ a) @ bt)

    v = jnp.ones((4, 4))
    jaxpr = jax.make_jaxpr(early_view)(v, v, v, v, v).jaxpr
    assert jaxpr.eqns[0].primitive.name == "transpose"
    assert _group(jaxpr, 0, bucket=1000) is None
    # Once the pass has evaluated the view (lazy, needing leaf 1), the group starting at the first use takes both.
    lazy = {**{var: (i,) for i, var in enumerate(jaxpr.invars[:4])}, jaxpr.eqns[0].outvars[0]: (1,)}
    start = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general")
    group = form_group(jaxpr.eqns, start, lazy, ELEMENTS.get, 1000, alone=lambda eqn, leaves: False)
    assert group.leaves == (0, 1) and group.uses == 2


def test_a_group_stops_before_an_effect():
    """A callback between two uses stays outside any group: the group's backward pass recomputes its
    body, and would run the callback again."""
    def noisy(a, b, x):
        h = jnp.tanh(x @ a)
        jax.debug.callback(lambda s: None, jnp.sum(h))
        return jnp.sum(h @ b)

    v = jnp.ones((4, 4))
    jaxpr = jax.make_jaxpr(noisy)(v, v, v).jaxpr
    lazy = {var: (i,) for i, var in enumerate(jaxpr.invars[:2])}
    start = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general")
    assert form_group(jaxpr.eqns, start, lazy, ELEMENTS.get, 1000, alone=lambda eqn, leaves: False) is None
