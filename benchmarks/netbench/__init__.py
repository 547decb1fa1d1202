"""Two-node, bandwidth-limited training benchmark on one Linux machine (needs root).

``python -m benchmarks.netbench --help``. Modules, one job each:

* :mod:`.netns` -- two network namespaces joined by a shaped veth pair, always torn down;
* :mod:`.sockettest` -- measures the link with a plain TCP stream before it is used;
* :mod:`.models` / :mod:`.modes` -- what is trained, and how gradients are exchanged;
* :mod:`.worker` -- one training process ("node"), launched like a user launches on a cluster;
* :mod:`.launch` -- starts the two nodes (or the one-process ideal) and collects their record;
* :mod:`.predict` -- the performance model's prediction for each mode;
* :mod:`.report` -- medians over repeats, the markdown table and the bar chart.
"""
