"""Smallest end-to-end call of the cudnn backend (forward with max/lse, then grads).

Run it under a debugger on the device when something crashes:
  cuda-gdb -batch -ex run -ex bt --args python3 tools/cudnn_smoke.py
"""
import jax
import jax.numpy as jnp
import numpy as np

import maxattn

rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((2, 128, 4, 64)), jnp.bfloat16) for _ in range(3))
for kwargs in ({}, {"return_max_logit": True}, {"return_lse": True}, {"return_max_logit": True, "return_lse": True}):
    res = maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn", **kwargs)
    ref = maxattn.reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=True,
                            **kwargs)
    res, ref = (res, ref) if kwargs else ((res, {}), (ref, {}))
    err = float(jnp.linalg.norm(res[0].astype(jnp.float32) - ref[0]) / jnp.linalg.norm(ref[0]))
    print("fwd", kwargs, "out rel err", err, {key: float(jnp.max(jnp.abs(res[1][key] - ref[1][key])))
                                               for key in res[1]}, flush=True)
g = jax.grad(lambda q: jnp.sum(maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
                               .astype(jnp.float32) ** 2))(q)
print("grad ok", float(jnp.linalg.norm(g.astype(jnp.float32))), flush=True)
