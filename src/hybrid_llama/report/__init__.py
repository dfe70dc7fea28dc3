"""Report figures (``plots``, ``quality_plots``), summary text (``summary``) and the HTML report."""
