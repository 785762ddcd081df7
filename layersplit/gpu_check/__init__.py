"""The prepared GPU check (``layersplit gpu-check``): :mod:`.run` (sections, budget, report),
:mod:`.cases` (the kernel cases and their checks), :mod:`.sanitize` (the stream-sanitizer section).
On a CPU it runs what a CPU can and marks the rest skipped."""
