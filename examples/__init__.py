"""fedgrid's example programs (docs/examples.rst). A regular package, so that ``examples.custom_strategy``
resolves to these files from the repository root even where an installed distribution ships a
top-level ``examples`` package of its own (Opacus, in the ``privacy`` extra, does).
"""
