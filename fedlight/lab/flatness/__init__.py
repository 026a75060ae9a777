"""``fedlight landscape`` and ``fedlight sharpness``: loss landscapes, the top Hessian eigenvalue and SAM
sharpness of a finished run's model.
"""
