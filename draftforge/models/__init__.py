"""draftforge.models"""
