"""draftforge.decode"""
