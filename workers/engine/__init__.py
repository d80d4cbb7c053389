"""The runner's engine: continuous batching on one llama.cpp context, in seven parts.

- :mod:`workers.engine.loop`: the decode loop (:class:`~workers.engine.loop.Engine`).
- :mod:`workers.engine.relay`: each step's tokens made into their jobs' text, off the
  decode thread, while the next step decodes.
- :mod:`workers.engine.job`: the state of one job in the loop, and the account of the
  loop's time.
- :mod:`workers.engine.batching`: batch layout: admission into sequence slots, prompt
  prefix reuse, what each sequence puts into a step and in which order.
- :mod:`workers.engine.sampling`: the sampler chain for a job's options, its grammar for
  a ``format``, and the plain greedy argmax.
- :mod:`workers.engine.text`: text and tokens: tokenizing a prompt, and from sampled
  tokens to the text a caller sees (pieces, UTF-8 buffering, stop strings, the token
  budget, the final stats).
- :mod:`workers.engine.load`: the llama.cpp backend, loading a model and creating its
  context, sized as the estimator sized it.

The pure parts (stop strings, UTF-8 buffering, token budget, sampler plan, admission and
slots) import no llama.cpp and are tested on their own. Nothing is re-exported here:
import each name from the module that owns it.
"""
