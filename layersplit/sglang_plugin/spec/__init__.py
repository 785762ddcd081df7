"""The speculative-decoding monitor's hooks inside SGLang (the monitor itself is :mod:`layersplit.pd.spec`).

- :mod:`.step` — an AFTER hook on the scheduler's per-verify-step method of ``Req``: judge each step,
  abort an anomalous request while it decodes;
- :mod:`.completion` — the fallback on releases without that method: judge each finished request's
  completion-time speculative metrics;
- :mod:`.abort` — the abort a verdict turns into (a finish reason the router retries);
- :mod:`.drive` — drives real ``Req`` objects through SGLang's own verify path (tests and the benchmark).

Imports nothing of the plug-in's pool; the plug-in's :func:`~layersplit.sglang_plugin.register` wires it.
"""
