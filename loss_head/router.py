class LossHeadRouter: pass
def route_loss_head(*a, **k): pass
