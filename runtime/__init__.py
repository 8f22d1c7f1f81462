"""gpupool runtime: the plumbing every stage process shares, kept apart from the contracts.

:mod:`contracts` holds what crosses a stage boundary (records, topic names, the bus interface);
this package holds how a process runs: the Kafka client (:mod:`runtime.kafka`, :mod:`runtime.bus`),
reading a topic to its end (:mod:`runtime.replay`), the deployment settings
(:mod:`runtime.settings`) and the run options of every stage (:mod:`runtime.run_options`), tracing
setup (:mod:`runtime.tracing`), retry backoff (:mod:`runtime.backoff`) and the AsyncAPI generator
(:mod:`runtime.asyncapi`). Stages may import it; :mod:`contracts` may not, so importing a record,
a parser or the edge SDK loads no Kafka client and no OpenTelemetry exporter.
"""
