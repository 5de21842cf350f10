"""Stage ``report``: the study's Tables 4 to 8 and the figures."""
