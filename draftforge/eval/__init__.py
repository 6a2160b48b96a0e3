"""draftforge.eval"""
