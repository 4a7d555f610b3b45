"""The snapshot's data model and what every layer shares: readings with their provenance
(`readings`), the backend contract every GPU backend implements (`gpusource`), their
formatting (`fmt`), the JSON Schema of the snapshot document (`schema`), and small readers
of /proc, command lines and cached files.

May import: nothing else of gputaskman.
"""
