"""GLM-5.3-Flash (`glm5_next`) serving model: config, weights, state and forward.

Import the submodules directly (`trnrt.models.glm5_next.model` etc.); this package file stays
light so that `import trnrt.models.glm5_next` does not pull in torch.
"""
