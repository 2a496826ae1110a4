"""Scripts of the course, meant to be started by a launcher such as torchrun:

    torchrun --standalone --nproc-per-node=4 -m distlab.scripts.hello_torchrun
"""
