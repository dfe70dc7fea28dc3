"""The report: result files read once (``results``), the headline table (``headline``), summary text
(``summary``), shared number formats (``formatting``), figures (``plots``, ``quality_plots``) and the
HTML page (``html``)."""
