"""`gputaskman serve`'s server: the sampling thread and the read-only routes (`server`), the
HTTP/1.1 server with keep-alive (`httpserve`), the bearer token and TLS with client
certificates (`httpauth`), and the sources served for demos and tests (`sources`). The
command line that starts it is `cli.serve`.

May import: gputaskman.base, gputaskman.sampling, gputaskman.document, gputaskman.render,
gputaskman.offline, gputaskman.fixtures.
"""
