"""Reports: pictures and traces of what runs when."""
