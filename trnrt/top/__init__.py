"""`trnrt top`: the live dashboard (trnrt.top.app, Textual) and its data sources (trnrt.top.source).

Never imports torch: the dashboard runs on any laptop against a remote server.
"""
