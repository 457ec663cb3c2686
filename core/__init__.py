"""remat's core: the plain data every stage stands on and the one judge of plans, without torch.

* `training_graph`: the TrainingGraph, what capture produces and every solver reads;
* `plan`: the Plan, its status and its file format; `module_summary`: a plan per module;
* `simulator`: replays a schedule over a TrainingGraph (peak bytes, cost): the judge of every plan;
* `errors`: RematError and RematWarning, the bases of every error and warning remat raises;
* `progress`: the progress lines long stages show on stderr;
* `full_collections`: fewer full garbage collections while a solver allocates by the million.

Every stage imports core; core imports no other stage, and no torch.
"""
